#!/usr/bin/env python3
"""What `deepinfer route` adds to a request (docs/router.md, "Cost"): starts one `deepinfer serve`
(the built-in tiny model) and a router in front of it on loopback, then alternates the same
requests direct and through the router and prints the medians: a non-streaming chat completion
of one token (the client keeps its connection alive) and the time to the first SSE event of a
streaming one (a new client connection each time, as most SDKs do).
    bench/router/overhead.py [build/deepinfer] [N=300]"""
import http.client
import json
import statistics
import sys
import time

from loopback import free_port, serve_env, start, stop, wait_ready

BIN = sys.argv[1] if len(sys.argv) > 1 else "build/deepinfer"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 300
BODY = {"model": "deepinfer-tiny", "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1, "temperature": 0}
STREAM = dict(BODY, stream=True, max_tokens=2)


def main():
    sp, rp = free_port(), free_port()
    procs = [start([BIN, "serve", "--port", str(sp), "--threads", "2"], serve_env())]
    try:
        wait_ready(sp, 600)
        procs.append(start([BIN, "route", "--port", str(rp), "--replica",
                            f"http://127.0.0.1:{sp}"]))
        wait_ready(rp, 600)
        conns = {p: http.client.HTTPConnection("127.0.0.1", p, timeout=60) for p in (sp, rp)}

        def plain(p):
            t = time.perf_counter()
            conns[p].request("POST", "/v1/chat/completions", json.dumps(BODY),
                             {"Content-Type": "application/json"})
            conns[p].getresponse().read()
            return time.perf_counter() - t

        def first_event(p):
            c = http.client.HTTPConnection("127.0.0.1", p, timeout=60)
            t = time.perf_counter()
            c.request("POST", "/v1/chat/completions", json.dumps(STREAM),
                      {"Content-Type": "application/json"})
            r = c.getresponse()
            while not r.readline().startswith(b"data: "):
                pass
            d = time.perf_counter() - t
            r.read()
            c.close()
            return d

        res = {k: [] for k in ("plain_direct", "plain_router", "ttfe_direct", "ttfe_router")}
        for _ in range(N):
            res["plain_direct"].append(plain(sp))
            res["plain_router"].append(plain(rp))
            res["ttfe_direct"].append(first_event(sp))
            res["ttfe_router"].append(first_event(rp))
        m = {k: statistics.median(v) * 1e3 for k, v in res.items()}
        print(f"N={N} non-streaming, max_tokens 1: direct {m['plain_direct']:.2f} ms, router "
              f"{m['plain_router']:.2f} ms, added {m['plain_router'] - m['plain_direct']:.2f} ms")
        print(f"streaming, time to first SSE event: direct {m['ttfe_direct']:.2f} ms, router "
              f"{m['ttfe_router']:.2f} ms, added {m['ttfe_router'] - m['ttfe_direct']:.2f} ms")
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
