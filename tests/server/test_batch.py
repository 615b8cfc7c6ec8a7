"""`deepinfer batch` (docs/server.md, "Offline batches"): an OpenAI Batch input file answered
offline with the serve routes' answers — every API's body equal to what `deepinfer serve` returns
for the same request (temperature 0 and seeded sampling, ids and times aside), the same at any
--concurrency, HTTP errors in the route's shape and status, lines that are not requests answered
with an error naming the line, a repeated custom_id rejected on its later lines (OpenAI requires them
unique in a batch), nothing lost; bad arguments are usage errors."""
import json
import os
import subprocess

from conftest import MODEL, Server, post

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello from a batch"}],
        "max_tokens": 8, "temperature": 0}
REQUESTS = [
    ("chat", "/v1/chat/completions", CHAT),
    ("chat-n2", "/v1/chat/completions",
     dict(CHAT, n=2, temperature=0.8, seed=11, max_tokens=6)),
    ("cmpl", "/v1/completions",
     {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}),
    ("resp", "/v1/responses",
     {"model": MODEL, "input": "Tell me", "max_output_tokens": 8, "temperature": 0}),
    ("msg", "/v1/messages", {"model": MODEL, "max_tokens": 8, "temperature": 0,
                             "messages": [{"role": "user", "content": "Hi Claude"}]}),
    ("json", "/v1/chat/completions",
     dict(CHAT, response_format={"type": "json_object"}, max_tokens=12)),
    ("bad-empty", "/v1/chat/completions", dict(CHAT, messages=[])),
    ("bad-model", "/v1/chat/completions", dict(CHAT, model="no-such-model")),
]
VOLATILE = {"id", "created", "created_at", "system_fingerprint"}


def strip(v):
    if isinstance(v, dict):
        return {k: strip(x) for k, x in v.items() if k not in VOLATILE}
    if isinstance(v, list):
        return [strip(x) for x in v]
    return v


def run_batch(server, lines, *args):
    path = os.path.join(server.home, "in.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    out = os.path.join(server.home, "out.jsonl")
    p = subprocess.run([os.environ["DEEPINFER_BIN"], "batch", "--input", path, "--output", out,
                        "--threads", "2", *args],
                       env=dict(os.environ, DEEPINFER_HOME=server.home),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    with open(out) as f:
        return [json.loads(x) for x in f], p.stderr


def test_batch_matches_serve():
    server = Server()  # the reference answers, and the home whose tiny model batch loads
    try:
        want = {}
        for cid, url, body in REQUESTS:
            st, _, got = post(server, url, body)
            want[cid] = (st, strip(got))
        assert want["chat"][0] == 200 and want["bad-empty"][0] == 400
        assert want["bad-model"][0] == 404
        lines = [json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})
                 for cid, url, body in REQUESTS]
        lines += ["", "this is not json", json.dumps({"custom_id": "x", "method": "GET",
                                                       "url": "/v1/models", "body": {}}),
                  json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
                  json.dumps({"custom_id": "stream", "method": "POST",
                              "url": "/v1/chat/completions", "body": dict(CHAT, stream=True)}),
                  json.dumps({"custom_id": "url", "method": "POST", "url": "/v1/embeddings",
                              "body": {}}),
                  # custom_id must be unique: a repeat of a good line's id, and of a bad line's
                  # (the first use owns the id whatever its answer), are not run.
                  json.dumps({"custom_id": "chat", "method": "POST",
                              "url": "/v1/completions", "body": REQUESTS[2][2]}),
                  json.dumps({"custom_id": "x", "method": "POST",
                              "url": "/v1/chat/completions", "body": CHAT})]
        results = {}
        for conc in ("1", "3", "16"):
            out, log = run_batch(server, lines, "--concurrency", conc)
            assert len(out) == len(lines) - 1, out  # every line answered, the blank one skipped
            ids = [o["id"] for o in out]
            assert len(set(ids)) == len(ids)
            by = {o["custom_id"]: o for o in out if o["custom_id"] and not o["error"]}
            for cid, _, _ in REQUESTS:
                r = by[cid]["response"]
                assert by[cid]["error"] is None
                assert (r["status_code"], strip(r["body"])) == want[cid], (conc, cid)
            errors = {(o["custom_id"], o["error"]["code"]) for o in out if o["error"]}
            assert errors == {(None, "invalid_json_line"), (None, "missing_custom_id"),
                              ("x", "invalid_method"), ("stream", "invalid_body"),
                              ("url", "invalid_url"), ("chat", "duplicate_custom_id"),
                              ("x", "duplicate_custom_id")}, errors
            assert [o["custom_id"] for o in out].count("chat") == 2
            dups = sorted(o["error"]["message"] for o in out
                          if o["error"] and o["error"]["code"] == "duplicate_custom_id")
            assert dups == ['line 15: "custom_id" "chat" is a duplicate of line 1\'s (custom_id '
                            'must be unique in a batch)',
                            'line 16: "custom_id" "x" is a duplicate of line 11\'s (custom_id '
                            'must be unique in a batch)'], dups
            anon = [o["error"] for o in out if o["custom_id"] is None]
            assert sorted(e["code"] for e in anon) == ["invalid_json_line", "missing_custom_id"]
            assert any("line 10:" in e["message"] for e in anon), anon  # names its line
            assert "7 answered 200" not in log and "6 answered 200, 2 with an HTTP error, 7 not " \
                "requests" in log, log
            results[conc] = {cid: strip(by[cid]["response"]["body"]) for cid, _, _ in REQUESTS}
        assert results["1"] == results["3"] == results["16"]
    finally:
        server.stop()


def test_batch_usage_errors():
    bin_ = os.environ["DEEPINFER_BIN"]
    p = subprocess.run([bin_, "batch"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--input" in p.stderr
    p = subprocess.run([bin_, "batch", "--input", "x", "--concurrency", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    p = subprocess.run([bin_, "batch", "--input", "/nonexistent/in.jsonl"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "cannot open /nonexistent/in.jsonl" in p.stderr
    p = subprocess.run([bin_, "batch", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "OpenAI Batch" in p.stdout
