#!/usr/bin/env python3
"""Tail snapshots (docs/kv-cache.md, "Tail snapshots"): what a prefix hit costs with them and
without (--tail-cache-mib 0, the bounded replay). Starts `deepinfer serve` on loopback for the
built-in tiny V4 model and the V4.1 tiny model (deepinfer synth --preset v41-tiny), each with and
without snapshots, and for N fresh prompts of about L tokens runs three legacy completions:
  cold      the prompt, 16 tokens generated (its tail is snapshot at its last block boundary);
  same      the same prompt again, 1 token (a hit of every full block below the last token);
  follow-up the prompt + the cold answer + a few words, 1 token (a follow-up turn: the hit
            reaches into the answer's blocks, the snapshot is the prompt's; on the V4.1 tiny
            model, whose random output is not valid input, the prompt + a few words).
and, on the V4 tiny model (the V4.1 tiny model's 512-id vocabulary cannot take a rendered chat
prompt; build/bench_snap measures both models on the engine API), N chat completions sharing one system prompt of about L
tokens, each with a different user message:
  system    1 token each; the first (cold) primes the cache, the others hit the system prompt's
            blocks: continued from the snapshot point at its end (docs/kv-cache.md, "Snapshot
            points"), or, with --tail-cache-mib 0, by the bounded replay (what every server did
            before snapshot points: the snapshots sat at each prompt's own last boundary).
For each: the request's wall time (max_tokens 1: prefill + one token, a TTFT), the prompt tokens
from the cache, and the positions the hit computed again (the replay counter's delta on /metrics).
Prints the medians and ranges.
    bench/prefix/tail.py [build/deepinfer] [N=5] [L=1000]"""
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

BIN = sys.argv[1] if len(sys.argv) > 1 else "build/deepinfer"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 5
L = int(sys.argv[3]) if len(sys.argv) > 3 else 1000


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(port, name):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def complete(port, model, prompt, max_tokens):
    b = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(b).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    r0 = metric(port, "deepinfer:prefix_cache_replayed_tokens_total")
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    dt = (time.perf_counter() - t) * 1e3
    u = out["usage"]
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    replayed = metric(port, "deepinfer:prefix_cache_replayed_tokens_total") - r0
    return out["choices"][0]["text"], dt, u["prompt_tokens"], cached, int(replayed)


def chat(port, model, system, user):
    b = {"model": model, "max_tokens": 1, "temperature": 0,
         "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(b).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    dt = (time.perf_counter() - t) * 1e3
    u = out["usage"]
    d = u["prompt_tokens_details"]
    return None, dt, u["prompt_tokens"], d["cached_tokens"], d["replayed_tokens"]


def serve(args, env):
    port = free_port()
    p = subprocess.Popen([BIN, "serve", "--port", str(port), "--threads", "2", "--max-ctx",
                          "4096", "--max-seqs", "2"] + args, env=env, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2):
                return p, port
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("not ready")


def main():
    env = dict(os.environ, DEEPINFER_HOME=tempfile.mkdtemp(prefix="deepinfer-bench-"))
    v41 = tempfile.mkdtemp(prefix="deepinfer-v41-")
    subprocess.run([BIN, "synth", "--preset", "v41-tiny", "--out", v41], check=True,
                   capture_output=True)
    models = [("V4 tiny", [], "deepinfer-tiny", lambda s: " ".join(
                  f"w{(i * 7 + s * 13) % 97}" for i in range(L // 2))),
              ("V4.1 tiny", ["--model", v41, "--served-model-name", "v41"], "v41",
               lambda s: " ".join([str(1 + s // 3**k % 3) for k in range(8)] +
                                  [str(1 + (i * 7 + i // 11) % 3) for i in range(L - 8)]))]
    for name, margs, model, text in models:
        for label, extra in (("snapshots", []), ("replay", ["--tail-cache-mib", "0"])):
            p, port = serve(margs + extra, env)
            rows = {"cold": [], "same": [], "follow-up": []}
            if model != "v41":
                rows["system"] = []
            try:
                for s in range(N):
                    prompt = text(s + (100 if label == "replay" else 0))
                    ans, dt, n, c, rp = complete(port, model, prompt, 16)
                    rows["cold"].append((dt, n, c, rp))
                    _, dt, n, c, rp = complete(port, model, prompt, 1)
                    rows["same"].append((dt, n, c, rp))
                    # (the V4.1 tiny model takes ids below 512: its turn goes on without the
                    # answer's text)
                    turn = prompt + (ans if model != "v41" else "") + " 1 2 3 3 2 1 1 2"
                    _, dt, n, c, rp = complete(port, model, turn, 1)
                    rows["follow-up"].append((dt, n, c, rp))
                if "system" in rows:
                    system = ("You are the assistant of session " + label + ". " +
                              text(7 + (100 if label == "replay" else 0)))
                    chat(port, model, system, "Hello.")  # cold: primes the cache
                    for s in range(N):
                        q = f"Question {s}: what does w{s * 11 % 97} mean in this text?"
                        rows["system"].append(chat(port, model, system, q)[1:])
                taken = metric(port, "deepinfer:tail_snapshots_taken_total")
                restored = metric(port, "deepinfer:tail_snapshots_restored_total")
                nbytes = metric(port, "deepinfer:tail_snapshot_bytes")
                held = metric(port, "deepinfer:tail_snapshots")
            finally:
                p.terminate()
                p.wait(timeout=60)
            per = f", {nbytes / held:.0f} bytes each" if held else ""
            print(f"{name}, {label} ({taken:.0f} taken, {restored:.0f} restored{per}):")
            for k, v in rows.items():
                ms = [r[0] for r in v]
                comp = [r[1] - r[2] + r[3] for r in v]
                print(f"  {k:9s} {statistics.median(ms):7.1f} ms ({min(ms):.1f}-{max(ms):.1f}), "
                      f"prompt {statistics.median([r[1] for r in v]):.0f}, cached "
                      f"{statistics.median([r[2] for r in v]):.0f}, replayed "
                      f"{statistics.median([r[3] for r in v]):.0f}, positions computed "
                      f"{statistics.median(comp):.0f}")


if __name__ == "__main__":
    main()
