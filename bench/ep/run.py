#!/usr/bin/env python3
"""Expert parallelism on one machine (docs/expert-parallel.md, "Measured"): starts W expert
workers (`deepinfer expert-worker`, the built-in tiny model) on loopback and runs `deepinfer bench`
on the same model without and with --ep-workers (after a warm-up run), and once more without with
as many threads as all the EP processes together. Prints prefill and decode tokens/s and the
ratios, the bytes exchanged per token (from bench's EP counters), and the loopback's own
limits measured in the same run with the same frame sizes: a raw TCP ping-pong of one MoE call's
request and reply (bytes per call = bytes per token x tokens per call) gives the bandwidth and the
round trip, so the exchange cost is shown as a fraction of the wall time.
    bench/ep/run.py [build/deepinfer] [W=1] [requests=4] [prompt_len=64] [gen_len=32] [threads=1]
DI_EP_MODEL=DIR runs a checkpoint instead of the built-in tiny model (e.g. `deepinfer synth
--preset flash-4l`: V4-Flash widths)."""
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

BIN = sys.argv[1] if len(sys.argv) > 1 else "build/deepinfer"
W = int(sys.argv[2]) if len(sys.argv) > 2 else 1
REQ, PLEN, GLEN, THREADS = (int(x) for x in (sys.argv[3:7] + ["4", "64", "32", "1"][len(sys.argv[3:7]):]))
MODEL = ["--model", os.environ["DI_EP_MODEL"]] if os.environ.get("DI_EP_MODEL") else []
ENV = dict(os.environ, DEEPINFER_HOME=os.environ.get("DEEPINFER_HOME") or tempfile.mkdtemp(prefix="deepinfer-bench-"))


def bench(extra, threads=THREADS):
    argv = [BIN, "bench", "--requests", str(REQ), "--prompt-len", str(PLEN), "--gen-len", str(GLEN),
            "--threads", str(threads), "--no-ratio", "--log-level", "error"] + MODEL + extra
    out = subprocess.run(argv, env=ENV, check=True, capture_output=True, text=True).stdout
    num = lambda pat: float(re.search(pat, out).group(1))
    r = {"prefill": num(r"prefill\s+([\d.]+) tokens/s"), "decode": num(r"decode\s+([\d.]+) tokens/s"),
         "wall": num(r"requests in ([\d.]+) s")}
    m = re.search(r"expert parallelism: \d+ workers, (\d+) tokens computed, (\d+) bytes exchanged per token", out)
    if m:
        r["tokens"], r["bpt"] = int(m.group(1)), int(m.group(2))
        r["calls"] = sum(int(x) for x in re.findall(r"expert worker \S+: (\d+) requests", out))
        r["wait"] = sum(float(x) for x in re.findall(r"([\d.]+) ms waiting", out)) / 1e3
        r["out"] = out
    return r


def pingpong(size, n):
    """Round trips of `size`-byte messages each way over loopback: (bytes/s one way, seconds per trip)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def echo():
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(size)
        for _ in range(n):
            view, got = memoryview(buf), 0
            while got < size:
                got += c.recv_into(view[got:])
            c.sendall(buf)
        c.close()

    th = threading.Thread(target=echo)
    th.start()
    s = socket.create_connection(srv.getsockname())
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg, buf = bytes(size), bytearray(size)
    t0 = time.perf_counter()
    for _ in range(n):
        s.sendall(msg)
        view, got = memoryview(buf), 0
        while got < size:
            got += s.recv_into(view[got:])
    dt = time.perf_counter() - t0
    th.join()
    s.close()
    srv.close()
    return 2 * size * n / dt, dt / n


def main():
    procs, addrs = [], []
    try:
        for _ in range(W):
            p = subprocess.Popen([BIN, "expert-worker", "--listen", "127.0.0.1:0", "--threads", str(THREADS),
                                  "--log-level", "error"] + MODEL, env=ENV, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
            procs.append(p)
            addrs.append("127.0.0.1:" + p.stdout.readline().strip().rsplit(":", 1)[1])
        bench([])  # warm-up: the checkpoint's pages in the page cache
        base = bench([])
        ep = bench(["--ep-workers", ",".join(addrs)])
        cores = bench([], THREADS * (W + 1))
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=60)
    print(f"{W} worker(s), {REQ} requests x ({PLEN} prompt + {GLEN} generated) tokens, {THREADS} thread(s) per process")
    for k in ("prefill", "decode"):
        print(f"  {k:8s} tokens/s: single process {base[k]:9.1f}   EP {ep[k]:9.1f}   ratio {ep[k] / base[k]:.2f}   "
              f"(single process with the same {THREADS * (W + 1)} threads in all: {cores[k]:.1f}, EP at {ep[k] / cores[k]:.2f} of it)")
    per_call = ep["bpt"] * ep["tokens"] / max(ep["calls"], 1)
    bw, rtt = pingpong(max(int(per_call / 2), 64), 2000)
    print(f"  exchanged: {ep['bpt']} bytes per token, {ep['calls']} requests, {per_call:.0f} bytes per request "
          f"(request + results)")
    print(f"  loopback, same frame sizes: {bw / 1e9:.2f} GB/s one way, {rtt * 1e6:.1f} us per round trip")
    wire = ep["tokens"] * ep["bpt"] / bw + ep["calls"] * rtt
    print(f"  wire time at that rate: {wire:.3f} s of the EP run's {ep['wall']:.2f} s ({100 * wire / ep['wall']:.1f} %); "
          f"the front waited {ep['wait']:.3f} s for results (wire + the workers' compute not overlapped)")


if __name__ == "__main__":
    main()
