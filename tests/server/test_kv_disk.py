"""The prefix cache's disk tier across a restart (docs/kv-cache.md, "Disk tier"): a server with
--kv-disk-dir answers a long prompt and is stopped (SIGTERM: its cached blocks are flushed to the
directory); a new server on the same directory answers the same prompt taking its prefix from disk
(usage cached_tokens > 0, the disk metrics count it; the blocks are read by the read thread's
admission prefetch; the tail snapshot comes back with its record, so nothing is replayed) with the
identical output at temperature 0.
A second server on a directory in use is refused at start."""
import os
import subprocess

from conftest import MODEL, Server, free_port, post

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box "
         "jovial zebras near old stone bridges under pale autumn skies").split()
CHAT = {"model": MODEL, "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user",
                      "content": " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(300))}]}


def ask(s):
    status, _, body = post(s, "/v1/chat/completions", CHAT)
    assert status == 200, body
    return body["choices"][0]["message"]["content"], body["usage"]


def test_disk_tier_survives_restart(tmp_path):
    d = str(tmp_path / "kv")
    s = Server(["--kv-disk-dir", d, "--kv-disk-bytes", "256M", "--kv-disk-ttl", "72h",
                "--kv-disk-queue", "64M"])
    try:
        first, usage = ask(s)
        assert usage["prompt_tokens"] > 200, usage
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
        m = s.metrics()
        assert m["deepinfer:kv_disk_blocks_written_total"] == 0  # nothing evicted yet
        # The write queue (the IO thread's): nothing queued, dropped or pending yet.
        assert m["deepinfer:kv_disk_writes_queued_total"] == 0
        assert m["deepinfer:kv_disk_writes_dropped_total"] == 0
        assert m["deepinfer:kv_disk_writes_pending"] == 0
        assert m["deepinfer:kv_disk_write_errors_total"] == 0
        # A second server on the same directory is refused while this one holds it.
        r = subprocess.run([os.environ["DEEPINFER_BIN"], "serve", "--port", str(free_port()),
                            "--threads", "1", "--kv-disk-dir", d],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, DEEPINFER_HOME=str(tmp_path)))
        assert r.returncode != 0
        assert "in use by another engine" in r.stderr, r.stderr
        # Prefetches at once: 1 to 64.
        r = subprocess.run([os.environ["DEEPINFER_BIN"], "serve", "--port", str(free_port()),
                            "--threads", "1", "--kv-disk-dir", d, "--kv-disk-prefetches", "0"],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, DEEPINFER_HOME=str(tmp_path)))
        assert r.returncode != 0
        assert "--kv-disk-prefetches" in r.stderr, r.stderr
    finally:
        rc, log = s.stop()
    assert rc == 0, log
    assert "cached blocks written at shutdown" in log, log

    s = Server(["--kv-disk-dir", d, "--kv-disk-read", "64M", "--kv-disk-prefetches", "2"])
    try:
        m = s.metrics()
        assert m["deepinfer:kv_disk_prefetches_total"] == 0
        assert m["deepinfer:kv_disk_records"] > 0
        assert m["deepinfer:kv_disk_queue_hits_total"] == 0
        assert m["deepinfer:kv_disk_bytes"] > 0
        again, usage = ask(s)
        assert again == first
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0, usage
        m = s.metrics()
        assert m["deepinfer:prefix_cache_disk_hit_tokens_total"] == cached
        assert m["deepinfer:kv_disk_blocks_read_total"] > 0
        assert m["deepinfer:kv_disk_dropped_total"] == 0
        # The prompt's tail snapshot came back with its block's record: nothing replayed.
        assert m["deepinfer:kv_disk_snapshots_read_total"] == 1
        assert m["deepinfer:tail_snapshots_restored_total"] == 1
        assert m["deepinfer:prefix_cache_replayed_tokens_total"] == 0
        # Read off the engine thread by one admission prefetch, which the request waited for.
        assert m["deepinfer:kv_disk_prefetches_total"] == 1
        assert m["deepinfer:kv_disk_prefetches_done_total"] == 1
        assert m["deepinfer:kv_disk_prefetch_blocks_total"] == m["deepinfer:kv_disk_blocks_read_total"]
        assert m["deepinfer:kv_disk_prefetch_bytes_total"] > 0
        assert m["deepinfer:kv_disk_prefetch_waits_total"] == 1
        assert m["deepinfer:kv_disk_prefetch_wait_seconds_total"] > 0
        assert m["deepinfer:kv_disk_prefetch_read_seconds_total"] > 0
    finally:
        rc, log = s.stop()
    assert rc == 0, log
