#!/usr/bin/env python3
"""Generates tests/data/tok/engram_map_v4.bin.gz: DeepSeek V4.1's Engram compressed token map
(transformers' build_compressed_token_map, reimplemented here on the raw `tokenizers` backend)
for a tokenizer.json, as the fixture of tests/unit/test_engram_map.c.

Format (gzip of little-endian int32): n_ids, n_keys, then one entry per token id: -1 when the
id opens a new key (its compressed id is then the number of keys seen so far), else the
compressed id of the earlier key it repeats. The -1 form keeps the file small.

Usage: python/gen_engram_map.py [tokenizer.json] [out.bin.gz]
"""
import gzip
import struct
import sys

from tokenizers import Regex, Tokenizer, normalizers


def build_map(backend):
    sentinel = "\ue000"
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    key_to_new = {}
    n = backend.get_vocab_size(with_added_tokens=True)
    lookup = [0] * n
    for token_id in range(n):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        new_id = key_to_new.get(key)
        if new_id is None:
            new_id = len(key_to_new)
            key_to_new[key] = new_id
        lookup[token_id] = new_id
    return lookup, len(key_to_new)


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "data/tokenizer/deepseek-v4/tokenizer.json"
    dst = sys.argv[2] if len(sys.argv) > 2 else "tests/data/tok/engram_map_v4.bin.gz"
    lookup, n_keys = build_map(Tokenizer.from_file(src))
    seen = 0
    enc = []
    for v in lookup:
        if v == seen:
            enc.append(-1)
            seen += 1
        else:
            enc.append(v)
    raw = struct.pack("<2i", len(lookup), n_keys) + struct.pack(f"<{len(enc)}i", *enc)
    with open(dst, "wb") as f:
        f.write(gzip.compress(raw, 9, mtime=0))
    print(f"{dst}: {len(lookup)} ids, {n_keys} keys")


if __name__ == "__main__":
    main()
