#!/usr/bin/env python3
"""Tail snapshots through the disk tier (docs/kv-cache.md, "Disk tier"): a conversation resumed
after a restart. For the built-in tiny V4 model, with snapshots and without (--tail-cache-mib 0,
the bounded replay), each on a fresh --kv-disk-dir: a first `deepinfer serve` runs N fresh
prompts of about L tokens (16 tokens generated each) and is stopped (SIGTERM: its cached blocks
are flushed to disk, with their snapshots); a second one on the same directory then runs
  same      each prompt again, 1 token (a disk hit of every full block below the last token);
  follow-up each prompt + its first answer + a few words, 1 token (the next turn).
For each: the request's wall time (max_tokens 1: prefill + one token, a TTFT), the prompt tokens
from the cache, the positions the hit computed again (the replay counter's delta on /metrics) and
the positions computed; and the disk tier's records, bytes and snapshots written / read.
    bench/prefix/disk_tail.py [build/deepinfer] [N=5] [L=1000]"""
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tail  # noqa: E402  (serve, complete, metric; its argv parsing is the same)

N, L = tail.N, tail.L


def text(s):
    return " ".join(f"w{(i * 7 + s * 13) % 97}" for i in range(L // 2))


def main():
    env = dict(os.environ, DEEPINFER_HOME=tempfile.mkdtemp(prefix="deepinfer-bench-"))
    model = "deepinfer-tiny"
    for label, extra in (("snapshots", []), ("replay", ["--tail-cache-mib", "0"])):
        disk = tempfile.mkdtemp(prefix="deepinfer-disk-")
        args = extra + ["--kv-disk-dir", disk]
        p, port = tail.serve(args, env)
        answers = []
        try:
            for s in range(N):
                answers.append(tail.complete(port, model, text(s), 16)[0])
        finally:
            p.terminate()
            p.wait(timeout=120)
        p, port = tail.serve(args, env)
        rows = {"same": [], "follow-up": []}
        try:
            records = tail.metric(port, "deepinfer:kv_disk_records")
            nbytes = tail.metric(port, "deepinfer:kv_disk_bytes")
            for s in range(N):
                _, dt, n, c, rp = tail.complete(port, model, text(s), 1)
                rows["same"].append((dt, n, c, rp))
            for s in range(N):
                turn = text(s) + answers[s] + " 1 2 3 3 2 1 1 2"
                _, dt, n, c, rp = tail.complete(port, model, turn, 1)
                rows["follow-up"].append((dt, n, c, rp))
            snaps_read = tail.metric(port, "deepinfer:kv_disk_snapshots_read_total")
            blocks_read = tail.metric(port, "deepinfer:kv_disk_blocks_read_total")
        finally:
            p.terminate()
            p.wait(timeout=120)
        print(f"V4 tiny, {label}: after the restart {records:.0f} records, {nbytes:.0f} bytes "
              f"({nbytes / max(records, 1):.0f} a record on average); {blocks_read:.0f} blocks "
              f"read, {snaps_read:.0f} with their snapshot")
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
