"""Writes and reads the fixture files: a small self-contained safetensors writer/reader (so the
exact dtype strings F8_E4M3 / F8_E8M0 / I8 / BF16 / F32 / I32 / I64 are under our control),
ref.safetensors and meta.json.

Tensor names in ref.safetensors (the C tests read these; `{l}` = decoder layer index):
  input_ids             I32 [T]
  logits                F32 [T, V]
  mtp_logits            F32 [T-1, V]   row t: MTP at position t fed embed(input_ids[t+1]) -> predicts t+2
  layer_out.{l}         F32 [T, hc_mult, D]   decoder layer l output streams
  attn_out.{l}          F32 [T, D]            attention module output of layer l (before hc_post)
  indexer_topk.{l}      I32 [T, index_topk]   CSA layers only: visible picks, ascending, -1 padded
  official_logits       F32 [T, V]     same, on the dequantised official (FP8/FP4) weights
  official_mtp_logits   F32 [T-1, V]
  gen_prompt            I32 [P]        (some fixtures) HF greedy generate prompt
  gen_tokens            I32 [N]        (some fixtures) the N new tokens
"""

from __future__ import annotations

import json
import struct

import torch

DTYPES = {
    # name: (torch storage dtype, bytes per element)
    "F32": (torch.float32, 4),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "F8_E4M3": (torch.uint8, 1),  # raw e4m3fn bytes
    "F8_E8M0": (torch.uint8, 1),  # raw UE8M0 bytes
}
_TORCH_TO_NAME = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8"}


def write_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """tensors: {name: tensor} or {name: (dtype_name, tensor)}. Layout as the safetensors library
    writes it: tensors ordered by (element size descending, name) so every tensor is naturally
    aligned, header padded with spaces to a multiple of 8, no holes."""
    items = []
    for name, v in tensors.items():
        dt, t = v if isinstance(v, tuple) else (_TORCH_TO_NAME[v.dtype], v)
        storage, size = DTYPES[dt]
        t = t.detach().contiguous()
        assert t.dtype == storage or t.element_size() == size, (name, dt, t.dtype)
        items.append((name, dt, t, size))
    items.sort(key=lambda x: (-x[3], x[0]))
    header, blobs, off = {}, [], 0
    for name, dt, t, size in items:
        b = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        assert len(b) == t.numel() * size
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_safetensors(path: str) -> tuple[dict, dict]:
    """Returns ({name: (dtype_name, tensor)}, metadata). F8 types come back as uint8 bytes."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, h in header.items():
        storage, size = DTYPES[h["dtype"]]
        a, b = h["data_offsets"]
        buf = bytearray(raw[base + a : base + b])
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        out[name] = (h["dtype"], t.view(storage).reshape(h["shape"]))
    return out, meta


def safetensors_keys(path: str) -> list[tuple[str, str, list]]:
    """[(name, dtype, shape)] in file-header order (as json.loads keeps it)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return [(k, v["dtype"], v["shape"]) for k, v in header.items()]


def write_ref(path: str, tensors: dict, generator: str) -> None:
    for name, t in tensors.items():
        if name in ("input_ids", "gen_prompt", "gen_tokens") or name.startswith("indexer_topk."):
            assert t.dtype == torch.int32, name
        else:
            assert t.dtype == torch.float32, name
    write_safetensors(path, tensors, metadata={"generator": generator})


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
