#!/usr/bin/env python3
"""Disk-tier reads at admission (docs/kv-cache.md, "Disk tier", "Measured, the read thread"): what a
resumed long prompt read back from disk costs a request that is decoding meanwhile. A first
`deepinfer serve --kv-disk-dir` runs a prompt of about L tokens (1 token) and is stopped (SIGTERM:
its cached blocks are flushed to disk, with its tail snapshot); a second one on the same directory
starts a streaming decode of a short prompt (G tokens) and, once it streams, sends the long prompt
again (1 token: a disk hit of every full block below its last token). Prints the decoding
request's inter-token gaps (median; max before the resume; max while the resumed prompt is read and
admitted), the resumed prompt's time to its token (a TTFT) and cached tokens, and the disk
counters (blocks read; on a server with the read thread, the engine thread's and the read
thread's time on the prefetch). R runs, each on a fresh directory.
    bench/prefix/disk_read.py BIN MODEL_DIR [L=3000] [G=48] [R=3]"""
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

BIN, MODEL = sys.argv[1], sys.argv[2]
L = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
G = int(sys.argv[4]) if len(sys.argv) > 4 else 48
R = int(sys.argv[5]) if len(sys.argv) > 5 else 3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(disk, env, log):
    port = free_port()
    p = subprocess.Popen([BIN, "serve", "--model", MODEL, "--served-model-name", "m", "--port",
                          str(port), "--threads", "2", "--max-ctx", str(L + 512), "--max-seqs",
                          "2", "--kv-disk-dir", disk, "--log-level", "info"], env=env,
                         stderr=log)
    for _ in range(3000):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2):
                return p, port
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("not ready")


def metrics(port):
    out = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("deepinfer:kv_disk") and "{" in line:
                out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def request(port, prompt, n, stream):
    b = {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream}
    return urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                  data=json.dumps(b).encode(), method="POST",
                                  headers={"Content-Type": "application/json"})


def long_prompt():
    return " ".join(f"w{(i * 7) % 97}" for i in range(L // 2))


def decode(port, times):
    with urllib.request.urlopen(request(port, "a short question about boats", G, True),
                                timeout=600) as r:
        for line in r:
            if line.startswith(b"data: ") and b"[DONE]" not in line:
                times.append(time.perf_counter())


def one_run(env):
    disk = tempfile.mkdtemp(prefix="deepinfer-disk-")
    log = open(os.path.join(disk, "..", os.path.basename(disk) + ".log"), "w")
    p, port = serve(disk, env, log)
    try:
        with urllib.request.urlopen(request(port, long_prompt(), 1, False), timeout=1200) as r:
            json.loads(r.read())
    finally:
        p.terminate()
        p.wait(timeout=300)
    p, port = serve(disk, env, log)
    try:
        times = []
        th = threading.Thread(target=decode, args=(port, times))
        th.start()
        while len(times) < 8:
            time.sleep(0.005)
        t0 = time.perf_counter()
        with urllib.request.urlopen(request(port, long_prompt(), 1, False), timeout=1200) as r:
            out = json.loads(r.read())
        t1 = time.perf_counter()
        th.join()
        m = metrics(port)
    finally:
        p.terminate()
        p.wait(timeout=300)
    log.close()
    gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    before = [g for a, g in zip(times[1:], gaps) if a < t0]
    during = [g for a, g in zip(times[1:], gaps) if t0 <= a <= t1 + 0.5]
    cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"itl_median": statistics.median(gaps), "itl_max_before": max(before),
            "itl_max_during": max(during) if during else float("nan"),
            "ttft": (t1 - t0) * 1e3, "prompt": out["usage"]["prompt_tokens"], "cached": cached,
            "blocks_read": m.get("deepinfer:kv_disk_blocks_read_total", 0),
            "engine_s": m.get("deepinfer:kv_disk_prefetch_engine_seconds_total", float("nan")),
            "read_s": m.get("deepinfer:kv_disk_prefetch_read_seconds_total", float("nan"))}


def main():
    env = dict(os.environ, DEEPINFER_HOME=tempfile.mkdtemp(prefix="deepinfer-bench-"))
    for i in range(R):
        r = one_run(env)
        print(f"run {i}: decode ITL median {r['itl_median']:.1f} ms, max before the resume "
              f"{r['itl_max_before']:.1f} ms, max while it is read and admitted "
              f"{r['itl_max_during']:.1f} ms; resumed prompt {r['prompt']} tokens, "
              f"{r['cached']} cached, {r['ttft']:.1f} ms to its token; {r['blocks_read']:.0f} "
              f"blocks read; prefetch: engine thread {r['engine_s'] * 1e3:.3f} ms, read thread "
              f"{r['read_s'] * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
