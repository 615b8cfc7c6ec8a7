"""64 concurrent streaming clients over loopback, a third disconnecting mid-stream: every
completed stream ends exactly once, no 5xx, and the KV pool is back to full afterwards."""
import http.client
import json
import threading
import time

from conftest import MODEL

N = 64


def one(server, i, out):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"client {i} " * (i % 7 + 1)}],
            "max_tokens": 24, "stream": True, "seed": i}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        out[i] = ("status", r.status)
        conn.close()
        return
    disconnect = i % 3 == 0
    done = finishes = 0
    lines = 0
    while True:
        line = r.readline()
        if not line:
            break
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        lines += 1
        if line == "data: [DONE]":
            done += 1
            continue
        ev = json.loads(line[6:])
        for c in ev.get("choices", []):
            if c.get("finish_reason"):
                finishes += 1
        if disconnect and lines >= 3:
            conn.sock.close()  # mid-stream disconnect
            out[i] = ("gone", 0)
            return
    conn.close()
    out[i] = ("ok", done, finishes)


def test_64_streams_with_disconnects(server):
    out = [None] * N
    threads = [threading.Thread(target=one, args=(server, i, out)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(o is not None for o in out), out
    assert not [o for o in out if o[0] == "status"], out
    ok = [o for o in out if o[0] == "ok"]
    assert len(ok) >= N * 2 // 3 - 1
    assert all(o[1] == 1 and o[2] == 1 for o in ok), out  # [DONE] once, one finish_reason
    # the disconnected requests are cancelled and the pool returns to full
    deadline = time.time() + 30
    while time.time() < deadline:
        m = server.metrics()
        if (m["deepinfer:kv_blocks_free"] == m["deepinfer:kv_blocks_total"]
                and m["deepinfer:num_requests_running"] == 0
                and m["deepinfer:num_http_requests_in_flight"] == 0):
            break
        time.sleep(0.2)
    assert m["deepinfer:kv_blocks_free"] == m["deepinfer:kv_blocks_total"], m
    assert m['deepinfer:http_responses_total{model_name="deepinfer-tiny",status="5xx"}'] == 0
    assert "client disconnected" in server.logtext()
