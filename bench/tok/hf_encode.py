#!/usr/bin/env python3
"""Encode throughput of HF tokenizers (Rust) on one thread over the same corpus texts.
Prints "hf: <strings> strings <bytes> bytes <ids> ids <seconds> s <MB/s> MB/s". encode_batch is
used (the fastest HF path: no Python per string); RAYON_NUM_THREADS=1 keeps it on one thread."""
import gzip
import json
import os
import sys
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer  # noqa: E402

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
corpus = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests/data/tok/corpus.jsonl.gz")
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
texts = [json.loads(l)["t"] for l in list(gzip.open(corpus, "rt", encoding="utf-8"))[1:]]
tok = Tokenizer.from_file(os.path.join(root, "data/tokenizer/deepseek-v4/tokenizer.json"))
nbytes = sum(len(t.encode("utf-8")) for t in texts)
best = 1e30
for _ in range(reps):
    t0 = time.perf_counter()
    out = tok.encode_batch(texts, add_special_tokens=False)
    dt = time.perf_counter() - t0
    best = min(best, dt)
n_ids = sum(len(e.ids) for e in out)
print(f"hf: {len(texts)} strings {nbytes} bytes {n_ids} ids {best:.3f} s {nbytes / best / 1e6:.2f} MB/s")
