#!/usr/bin/env python3
"""Context parallelism on one machine (docs/context-parallel.md, "Measured"): starts W prefill
workers (`deepinfer cp-worker`, the built-in tiny model unless DI_CP_MODEL names a checkpoint) on
loopback and times the prefill of one prompt of N tokens with `deepinfer generate --timing`: one
process with T threads, the front (T threads) with --cp-workers (each worker T threads: W + 1
ranks), and one process with T (W + 1) threads (the same cores as all the ranks together), after a
warm-up run. Prints prefill tokens/s, the ratios and the bytes exchanged per token, all measured in
this run. The logits of the three runs are the same (the generated token is compared).
    bench/cp/run.py [build/deepinfer] [N=4096] [W=1] [T=1]
DI_CP_MODEL=DIR runs a checkpoint instead of the built-in tiny model (e.g. `deepinfer synth
--preset flash-4l`: V4-Flash widths, 4 layers; or a DeepSeek V4.1 one, `deepinfer synth --preset
v41-tiny`)."""
import os
import re
import subprocess
import sys
import tempfile

BIN = sys.argv[1] if len(sys.argv) > 1 else "build/deepinfer"
N, W, T = (int(x) for x in (sys.argv[2:5] + ["4096", "1", "1"][len(sys.argv[2:5]):]))
MODEL = ["--model", os.environ["DI_CP_MODEL"]] if os.environ.get("DI_CP_MODEL") else []
ENV = dict(os.environ, DEEPINFER_HOME=os.environ.get("DEEPINFER_HOME") or tempfile.mkdtemp(prefix="deepinfer-bench-"))
IDS = ",".join(str((t * 7919 + 13) % 500 + 1) for t in range(N))


def prefill(extra, threads):
    argv = [BIN, "generate", "--tokens", IDS, "-n", "1", "--timing", "--threads", str(threads),
            "--log-level", "error"] + MODEL + extra
    r = subprocess.run(argv, env=ENV, check=True, capture_output=True, text=True)
    m = re.search(r"prefill: (\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s\)", r.stderr)
    out = {"tps": float(m.group(3)), "s": float(m.group(2)), "token": r.stdout.strip()}
    m = re.search(r"(\d+) bytes exchanged \(([\d.]+) per token\)", r.stderr)
    if m:
        out["bytes"], out["bpt"] = int(m.group(1)), float(m.group(2))
    return out


def main():
    procs, addrs = [], []
    try:
        for _ in range(W):
            p = subprocess.Popen([BIN, "cp-worker", "--listen", "127.0.0.1:0", "--threads", str(T),
                                  "--log-level", "error"] + MODEL, env=ENV, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
            procs.append(p)
            addrs.append("127.0.0.1:" + p.stdout.readline().strip().rsplit(":", 1)[1])
        prefill([], T)  # warm-up: the checkpoint's pages in the page cache
        base = prefill([], T)
        cp = prefill(["--cp-workers", ",".join(addrs), "--cp-min-tokens", "1"], T)
        cores = prefill([], T * (W + 1))
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=60)
    same = base["token"] == cp["token"] == cores["token"]
    print(f"prefill of {N} tokens, {W + 1} ranks (front + {W} worker(s)) of {T} thread(s) each"
          f"{' on ' + os.environ['DI_CP_MODEL'] if MODEL else ' (built-in tiny model)'}")
    print(f"  one process, {T} thread(s):      {base['tps']:9.1f} tokens/s  ({base['s']:.2f} s)")
    print(f"  context parallel, {W + 1} ranks:     {cp['tps']:9.1f} tokens/s  ({cp['s']:.2f} s)   "
          f"ratio {cp['tps'] / base['tps']:.2f}")
    print(f"  one process, {T * (W + 1)} thread(s):      {cores['tps']:9.1f} tokens/s  ({cores['s']:.2f} s)   "
          f"ratio {cores['tps'] / base['tps']:.2f}; CP at {cp['tps'] / cores['tps']:.2f} of it")
    print(f"  exchanged: {cp.get('bytes', 0)} bytes, {cp.get('bpt', 0):.0f} bytes per prompt token")
    print(f"  same next token in all three runs: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
