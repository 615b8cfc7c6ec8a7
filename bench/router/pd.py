#!/usr/bin/env python3
"""Prefill/decode disaggregation on one machine (docs/disaggregation.md, "Measured"): starts a plain
`deepinfer serve` (the built-in tiny model), a prefill and a decode replica (--kv-transfer) and a
router in PD mode in front of them, on loopback. For each prompt length and N fresh prompts (no
cache hits across trials) it measures:
  - TTFT (time to the first SSE event carrying a token) direct on the plain replica vs through the
    PD router (prefill call, KV transfer, import, then the decode replica's bounded replay);
  - the pieces on a further fresh prompt: the prefill call (prompt computed and exported), the
    transfer's bytes per prompt token, the import call, and the decode replica's TTFT after the
    import (its remaining work: replay of the window suffix) vs the plain replica's TTFT for the
    same prompt (its whole prefill): the decode replica's time saved;
  - a conversation's second turn (the first turn's messages, its answer and a short question)
    through the PD router: with the probe (the default --pd-min-new-tokens 256: the decode replica
    holds the first turn, the prefill step is skipped) vs a router with --pd-min-new-tokens 0 (the
    step runs: prefill on the prefill replica, where the prefix is cached too, and the whole chain
    moved again); and the probe call alone.
Prints the median and the range of each.
    bench/router/pd.py [build/deepinfer] [N=5] [words per prompt, comma-separated: 600,1500]"""
import http.client
import json
import statistics
import sys
import time
import urllib.request

from loopback import free_port, serve_env, start, stop, wait_ready

BIN = sys.argv[1] if len(sys.argv) > 1 else "build/deepinfer"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 5
LENGTHS = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "600,1500").split(",")]
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box jovial zebras "
         "near old stone bridges under pale autumn skies").split()


def body(n_words, seed, stream=True):
    text = " ".join(WORDS[(i * 7 + seed * 13 + i // 5) % len(WORDS)] for i in range(n_words))
    return {"model": "deepinfer-tiny", "temperature": 0, "max_tokens": 2, "stream": stream,
            "messages": [{"role": "user", "content": f"{seed} {text}"}]}


def second_turn(b):
    return dict(b, messages=b["messages"] + [{"role": "assistant", "content": "ok"},
                                             {"role": "user", "content": "and then what?"}])


def ttft(port, b):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(b), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    d = None
    while True:
        line = r.readline()
        if not line:
            break
        if d is None and line.startswith(b"data: {"):
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content") or delta.get("reasoning_content"):
                d = time.perf_counter() - t
    c.close()
    return d


def post(port, path, data, ctype):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST",
                                 headers={"Content-Type": ctype})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        out, hdrs = r.read(), dict(r.headers)
    return time.perf_counter() - t, out, hdrs


def fmt(v, unit=1e3, suffix="ms"):
    return (f"{statistics.median(v) * unit:.0f} {suffix} "
            f"({min(v) * unit:.0f}-{max(v) * unit:.0f})")


def main():
    env = serve_env()
    sp, pp, dp, rp, rp0 = (free_port() for _ in range(5))
    procs = []
    try:
        for port, extra in ((sp, []), (pp, ["--kv-transfer"]), (dp, ["--kv-transfer"])):
            procs.append(start([BIN, "serve", "--port", str(port), "--threads", "2", *extra], env))
            wait_ready(port, 1200)
        procs.append(start([BIN, "route", "--port", str(rp), "--pd-min-bytes", "0", "--prefill",
                            f"http://127.0.0.1:{pp}", "--decode", f"http://127.0.0.1:{dp}"]))
        procs.append(start([BIN, "route", "--port", str(rp0), "--pd-min-bytes", "0",
                            "--pd-min-new-tokens", "0", "--prefill", f"http://127.0.0.1:{pp}",
                            "--decode", f"http://127.0.0.1:{dp}"]))
        wait_ready(rp, 1200)
        wait_ready(rp0, 1200)
        time.sleep(1)  # the routers' first health polls
        seed = 0
        for n_words in LENGTHS:
            res = {k: [] for k in ("direct", "pd", "prefill", "import", "dec", "full", "bpt",
                                   "turn", "turn0", "probe")}
            n_tok = 0
            for _ in range(N):
                seed += 1
                res["direct"].append(ttft(sp, body(n_words, seed)))
                seed += 1
                res["pd"].append(ttft(rp, body(n_words, seed)))
                seed += 1
                b = body(n_words, seed)
                t_pre, x, h = post(pp, "/internal/prefill?route=/v1/chat/completions",
                                   json.dumps(b).encode(), "application/json")
                t_imp, _, _ = post(dp, "/internal/kv", x, "application/octet-stream")
                n_tok = int(h["X-Deepinfer-Prompt-Tokens"])
                res["prefill"].append(t_pre)
                res["import"].append(t_imp)
                res["bpt"].append(len(x) / n_tok)
                res["dec"].append(ttft(dp, b))
                res["full"].append(ttft(sp, b))
                for port, key in ((rp, "turn"), (rp0, "turn0")):
                    seed += 1
                    first = body(n_words, seed)
                    ttft(port, first)
                    res[key].append(ttft(port, second_turn(first)))
                res["probe"].append(post(dp, "/internal/kv/probe?route=/v1/chat/completions",
                                         json.dumps(second_turn(first)).encode(),
                                         "application/json")[0])
            saved = [f - d for f, d in zip(res["full"], res["dec"])]
            print(f"prompt {n_tok} tokens, N={N} (median, range):")
            print(f"  TTFT direct on one replica   {fmt(res['direct'])}")
            print(f"  TTFT through the PD router   {fmt(res['pd'])}")
            print(f"  prefill call (compute+export) {fmt(res['prefill'])}")
            print(f"  import call                  {fmt(res['import'])}, transfer "
                  f"{statistics.median(res['bpt']):.0f} bytes per prompt token "
                  f"({statistics.median(res['bpt']) * n_tok / 2**20:.2f} MiB)")
            print(f"  decode replica TTFT after import {fmt(res['dec'])} vs full prefill "
                  f"{fmt(res['full'])}: saved {fmt(saved)}")
            print(f"  second turn through PD: probe, step skipped {fmt(res['turn'])} vs step "
                  f"run again {fmt(res['turn0'])}; the probe call {fmt(res['probe'])}")
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
