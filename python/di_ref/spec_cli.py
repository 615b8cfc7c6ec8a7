"""Stand-in for the C CLI's `logits` subcommand, built on di_ref/model.py (the spec implemented in
Python). Same interface, so check_unseen.py's Python half can be tested before the C CLI exists,
and so the checkpoint-directory conventions (key names, mtp.safetensors, official FP8/FP4 layout)
have a runnable reference reader:

    python -m di_ref.spec_cli logits --model DIR --tokens 1,2,3 --out x.npy [--mtp-out m.npy]

DIR is either a save_pretrained directory (+ mtp.safetensors) or an official-layout directory
(config.json with quantization_config; FP8/FP4 tensors are dequantised, spec §4.3).
Writes float32 .npy: logits [T, vocab]; --mtp-out [T-1, vocab].
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

from . import dump, official, tiny
from .model import SpecModel


def load_dir(d: str) -> tuple[dict, dict]:
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    stored = {}
    for fn in ("model.safetensors", "mtp.safetensors"):
        p = os.path.join(d, fn)
        if os.path.exists(p):
            stored.update(dump.read_safetensors(p)[0])
    if "quantization_config" in cfg:
        w = official.dequantise(stored)
    else:
        w = {k: t for k, (_dt, t) in stored.items()}
    w = tiny.saved_to_official(w)
    if "qk_rope_head_dim" not in cfg:
        cfg["qk_rope_head_dim"] = int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    return cfg, w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="spec_cli")
    ap.add_argument("--no-shared-clamp", action="store_true", help="run the shared expert unclamped")
    sub = ap.add_subparsers(dest="cmd", required=True)
    lg = sub.add_parser("logits")
    lg.add_argument("--model", required=True)
    lg.add_argument("--tokens", required=True)
    lg.add_argument("--out", required=True)
    lg.add_argument("--mtp-out")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    cfg, w = load_dir(a.model)
    ids = torch.tensor([int(x) for x in a.tokens.split(",")], dtype=torch.long)
    out = SpecModel(cfg, w, shared_expert_clamp=not a.no_shared_clamp).forward(ids)
    np.save(a.out, out["logits"].numpy().astype(np.float32))
    if a.mtp_out:
        if "mtp_logits" not in out:
            print("spec_cli: checkpoint has no mtp.0.* tensors", file=sys.stderr)
            return 1
        np.save(a.mtp_out, out["mtp_logits"].numpy().astype(np.float32))
    return 0


if __name__ == "__main__":
    sys.exit(main())
