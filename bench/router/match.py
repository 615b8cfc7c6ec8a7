#!/usr/bin/env python3
"""The router's prefix match (docs/router.md, "Prefix match") on one machine: three `deepinfer serve`
replicas (the built-in tiny model) behind two routers on loopback, one with the match (the
default) and one with `--match-bytes 0` (the ring alone). Each router gets its own workload (other
texts, so neither profits from what the other's requests left in the replicas' caches):
  - `system`: G system prompts of ~900 bytes (shorter than the ring's 1,024-byte key, so the ring
    places each request by its user turn too), each followed by U different user turns;
  - `document`: G documents of ~3,500 bytes (longer than the key: the ring keeps each on one
    replica already), each followed by U different questions.
Requests go in rounds (every group's k-th turn, then the (k+1)-th), one at a time. Prints, per
workload and router: the prompt tokens the replicas took from their prefix caches over all
prompt tokens, the replicas each group's requests landed on (mean distinct), and the median
request time (max_tokens 1: about the prefill).
    bench/router/match.py [build/deepinfer] [G=4] [U=6]"""
import json
import statistics
import sys
import time
import urllib.request

from loopback import free_port, serve_env, start, stop, wait_ready

BIN = sys.argv[1] if len(sys.argv) > 1 else "build/deepinfer"
G = int(sys.argv[2]) if len(sys.argv) > 2 else 4
U = int(sys.argv[3]) if len(sys.argv) > 3 else 6


def system_prompt(tag, g):
    return " ".join(f"{tag}{g} rule {k}: answer briefly and politely." for k in range(23))


def document(tag, g):
    return " ".join(f"{tag}{g} section {k}: the quick brown fox jumps over the lazy dog." for k in
                    range(60))


def request(kind, tag, g, u):
    first = system_prompt(tag, g) if kind == "system" else document(tag, g)
    return {"model": "deepinfer-tiny", "temperature": 0, "max_tokens": 1,
            "messages": [{"role": "system", "content": first},
                         {"role": "user", "content": f"question {u}: {'why ' * u}now?"}]}


def post(port, b):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(b).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        out, hdrs = json.loads(r.read()), dict(r.headers)
    return time.perf_counter() - t, out, int(hdrs["X-Deepinfer-Replica"])


def run(port, kind, tag):
    prompt = cached = 0
    times, where = [], {g: set() for g in range(G)}
    for u in range(U):
        for g in range(G):
            t, out, rep = post(port, request(kind, tag, g, u))
            usage = out["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            times.append(t)
            where[g].add(rep)
    spread = statistics.mean(len(v) for v in where.values())
    return cached / prompt, spread, statistics.median(times)


def main():
    env = serve_env()
    reps = [free_port() for _ in range(3)]
    rm, r0 = free_port(), free_port()
    procs = []
    try:
        for port in reps:
            procs.append(start([BIN, "serve", "--port", str(port), "--threads", "1"], env))
            wait_ready(port, 1200)
        urls = [a for p in reps for a in ("--replica", f"http://127.0.0.1:{p}")]
        procs.append(start([BIN, "route", "--port", str(rm), *urls]))
        procs.append(start([BIN, "route", "--port", str(r0), "--match-bytes", "0", *urls]))
        wait_ready(rm, 1200)
        wait_ready(r0, 1200)
        time.sleep(1.5)  # the routers' first health polls
        print(f"3 replicas, {G} groups x {U} requests per workload and router")
        print(f"{'workload':<10} {'router':<14} {'cached/prompt':>13} {'replicas/group':>15} "
              f"{'median ms':>10}")
        for kind in ("system", "document"):
            res = {}
            for name, port, tag in (("match", rm, "m"), ("ring only", r0, "r")):
                res[name] = run(port, kind, f"{kind[0]}{tag}")
                c, s, t = res[name]
                print(f"{kind:<10} {name:<14} {c:>13.3f} {s:>15.2f} {t * 1e3:>10.1f}")
            print(f"{kind:<10} {'match / ring':<14} "
                  f"{res['match'][0] / max(res['ring only'][0], 1e-9):>13.2f}")
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
