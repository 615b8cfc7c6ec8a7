#!/usr/bin/env python3
"""End-to-end check of the C engine on a checkpoint it has never seen (config and seed not among the
committed fixtures):

    python/.venv/bin/python python/check_unseen.py --seed 17 --variant unseen_mixed

1. builds a random checkpoint from the variant's config and the seed (di_ref/tiny.py), picks input
   ids whose indexer/router top-k decisions are not near-ties;
2. saves it with save_pretrained into a temporary directory (+ mtp.safetensors, official names),
   or with --official in the official FP8/FP4 layout (reference = dequantised weights);
3. runs the HF reference (logits, MTP logits);
4. runs `<repo>/build/deepinfer logits --model DIR --tokens 1,2,3,... --out X.npy --mtp-out M.npy`
   (float32 .npy [T, vocab] and [T-1, vocab]);
5. prints max |diff| / max |ref| for logits and MTP logits; exits 1 above 1e-4 (spec §6.3).

Exit codes: 0 pass, 1 mismatch, 2 the engine failed or is missing, 3 bad arguments.

DeepSeek-V4.1 (`--arch v41`, R-HF V4.1 installed by install_v41_reference.py):

    python/.venv/bin/python python/check_unseen.py --arch v41 --seed 5 [--variant unseen] \
        [--official | --save-pretrained]

builds a V4.1 checkpoint from a preset of di_ref/v41.py (default `unseen`, not a fixture config) and
the seed, picks tie-free input ids (indexer, candidate-block and router gaps), writes it as the V4.1
fixtures' hf/ layout (composite config.json + native names, BF16/F32) or with --official the official
FP8/FP4 layout (same values), runs `<repo>/build/deepinfer logits --model DIR --tokens ... --out X.npy`
and compares all-position logits with R-HF (FP32, one-shot). There is no MTP/DSpark output for V4.1.
`--deepinfer "python/.venv/bin/python -m di_ref.v41_cli"` runs R-HF itself in the engine's place (hf/
layout only; checks the script).
`--deepinfer "python -m di_ref.spec_cli"` runs the Python spec implementation in the engine's place
(tests this script without the C CLI).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
REPO = os.path.dirname(HERE)

TOL = 1e-4  # spec §6.3: max |dlogit| <~ 1e-4 (relative to the largest reference logit here)


def fixture_seeds() -> dict:
    import gen_golden

    return {spec["preset"]: spec["seed"] for spec in gen_golden.FIXTURES.values()}


def main(argv=None) -> int:
    if "--arch" in (sys.argv[1:] if argv is None else argv):
        return main_arch(argv)
    import numpy as np
    import torch

    from di_ref import dump, hf, official, tiny

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--variant", default="unseen_mixed", choices=sorted(tiny.PRESETS))
    ap.add_argument("--T", type=int, default=48, help="tokens (default 48)")
    ap.add_argument("--deepinfer", default=os.path.join(REPO, "build", "deepinfer"),
                    help="engine command (default <repo>/build/deepinfer)")
    ap.add_argument("--official", action="store_true", help="write the official FP8/FP4 layout instead")
    ap.add_argument("--fp32", action="store_true", help="save FP32 instead of BF16 (save_pretrained layout)")
    ap.add_argument("--keep", help="keep the checkpoint and outputs in this directory")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    seeds = fixture_seeds()
    if seeds.get(a.variant) == a.seed:
        print(f"seed {a.seed} with variant {a.variant} is a committed fixture; pick another", file=sys.stderr)
        return 3

    cfg = tiny.make_config(a.variant)
    model, mtp = tiny.build(cfg, a.seed)
    if a.official:
        stored = official.quantise(tiny.official_state_dict(model, mtp))
        ref_model, ref_mtp = tiny.build(cfg, a.seed)
        tiny.load_official_into_(ref_model, ref_mtp, official.dequantise(stored))
    else:
        ref_model, ref_mtp = model, mtp

    # Input ids without near-tie top-k decisions (they would make any engine "fail" at random).
    for k in range(200):
        ids = tiny.random_ids(a.T, cfg.vocab_size, a.seed * 1000 + 17 + k)
        ref, st = hf.reference(ref_model, ref_mtp, ids)
        if hf.gaps_ok(st):
            break
    else:
        print("no input without top-k near-ties found", file=sys.stderr)
        return 3

    work = a.keep or tempfile.mkdtemp(prefix="di_unseen_")
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, "ckpt")
    if os.path.exists(ckpt):
        shutil.rmtree(ckpt)
    if a.official:
        model.save_pretrained(os.path.join(work, "tmp_hf"), safe_serialization=True)
        import json

        with open(os.path.join(work, "tmp_hf", "config.json")) as f:
            hf_cfg = json.load(f)
        shutil.rmtree(os.path.join(work, "tmp_hf"))
        official.write(ckpt, hf_cfg, stored)
    else:
        m = model if a.fp32 else model.to(torch.bfloat16)
        t = mtp if a.fp32 else mtp.to(torch.bfloat16)
        m.save_pretrained(ckpt, safe_serialization=True)
        dump.write_safetensors(os.path.join(ckpt, "mtp.safetensors"), tiny.mtp_official_state_dict(t),
                               metadata={"format": "pt"})
    x_npy, m_npy = os.path.join(work, "logits.npy"), os.path.join(work, "mtp_logits.npy")
    cmd = shlex.split(a.deepinfer) + [
        "logits", "--model", ckpt, "--tokens", ",".join(str(int(i)) for i in ids),
        "--out", x_npy, "--mtp-out", m_npy,
    ]
    print(f"variant {a.variant}, seed {a.seed}, T {a.T}, layers {cfg.layer_types}, "
          f"{'official FP8/FP4' if a.official else ('fp32' if a.fp32 else 'bf16')} checkpoint in {ckpt}")
    print("running:", " ".join(shlex.quote(c) for c in cmd[:6]), "...")
    env = dict(os.environ)
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    try:
        r = subprocess.run(cmd, env=env)
    except FileNotFoundError:
        print(f"engine not found: {cmd[0]} (build it first: cmake --build build)", file=sys.stderr)
        return 2
    if r.returncode != 0 or not os.path.exists(x_npy):
        print(f"engine failed (exit {r.returncode})", file=sys.stderr)
        return 2

    worst = 0.0
    for name, path, want in (("logits", x_npy, ref["logits"]), ("mtp_logits", m_npy, ref["mtp_logits"])):
        if not os.path.exists(path):
            print(f"{name}: engine wrote no {path}")
            worst = float("inf")
            continue
        got = np.load(path)
        want = want.numpy()
        if got.shape != want.shape or got.dtype != np.float32:
            print(f"{name}: got {got.dtype} {got.shape}, want float32 {want.shape}")
            worst = float("inf")
            continue
        d = float(np.abs(got.astype(np.float64) - want).max())
        rel = d / float(np.abs(want).max())
        worst = max(worst, rel if np.isfinite(rel) else float("inf"))
        print(f"{name:11s} max|diff| {d:.3e}  max|ref| {np.abs(want).max():.3f}  rel {rel:.3e}  "
              f"argmax agree {np.mean(got.argmax(-1) == want.argmax(-1)) * 100:.1f}%")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    ok = worst <= TOL
    print(f"{'PASS' if ok else 'FAIL'}: worst relative difference {worst:.3e} (tolerance {TOL:g})")
    return 0 if ok else 1


def main_arch(argv=None) -> int:
    """--arch v4 (the default path above) or --arch v41."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["v4", "v41"], required=True)
    a, rest = ap.parse_known_args(argv)
    if a.arch == "v4":
        return main([x for x in (sys.argv[1:] if argv is None else argv) if x not in ("--arch", "v4")])
    return main_v41(rest)


def main_v41(argv) -> int:
    import numpy as np
    import torch

    import gen_golden_v41
    from di_ref import v41

    ap = argparse.ArgumentParser(prog="check_unseen.py --arch v41")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--variant", default="unseen", choices=sorted(v41.PRESETS))
    ap.add_argument("--T", type=int, default=48, help="tokens (default 48)")
    ap.add_argument("--deepinfer", default=os.path.join(REPO, "build", "deepinfer"))
    ap.add_argument("--official", action="store_true", help="write the official FP8/FP4 layout instead")
    ap.add_argument("--save-pretrained", action="store_true",
                    help="write the checkpoint with transformers' save_pretrained (its own tensor names)")
    ap.add_argument("--keep", help="keep the checkpoint and outputs in this directory")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.official and a.save_pretrained:
        print("--official and --save-pretrained are two different layouts; pick one", file=sys.stderr)
        return 3
    if any(f["preset"] == a.variant and f["seed"] == a.seed for f in gen_golden_v41.FIXTURES.values()):
        print(f"seed {a.seed} with variant {a.variant} is a committed fixture; pick another", file=sys.stderr)
        return 3

    cfg = v41.make_config(a.variant)
    model = v41.build(cfg, a.seed)
    for k in range(200):
        ids = v41.random_ids(a.T, cfg.vocab_size, a.seed * 1000 + 17 + k)
        cap = v41.run(model, ids)
        if gen_golden_v41.gaps_ok(v41.min_gaps(cap)):
            break
    else:
        print("no input without top-k near-ties found", file=sys.stderr)
        return 3
    want = cap["logits"].numpy()

    work = a.keep or tempfile.mkdtemp(prefix="di_unseen_v41_")
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, "ckpt")
    if os.path.exists(ckpt):
        shutil.rmtree(ckpt)
    native = v41.native_state_dict(model)
    if a.official:
        v41.write_official(ckpt, cfg, native)
    elif a.save_pretrained:
        model.save_pretrained(ckpt)
    else:
        v41.write_hf(ckpt, cfg, native)
    v41.write_token_map(ckpt, cfg)  # the stub map the reference ran with (R-HF binds it in memory)
    x_npy = os.path.join(work, "logits.npy")
    cmd = shlex.split(a.deepinfer) + ["logits", "--model", ckpt, "--tokens", ",".join(str(int(i)) for i in ids),
                                      "--out", x_npy]
    print(f"V4.1 variant {a.variant}, seed {a.seed}, T {a.T}, ratios {cfg.compress_ratios}, "
          f"{'official FP8/FP4' if a.official else 'save_pretrained' if a.save_pretrained else 'hf (native names, bf16)'}"
          f" checkpoint in {ckpt}")
    print("running:", " ".join(shlex.quote(c) for c in cmd[:6]), "...")
    env = dict(os.environ)
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    try:
        r = subprocess.run(cmd, env=env)
    except FileNotFoundError:
        print(f"engine not found: {cmd[0]} (build it first: cmake --build build)", file=sys.stderr)
        return 2
    if r.returncode != 0 or not os.path.exists(x_npy):
        print(f"engine failed (exit {r.returncode})", file=sys.stderr)
        return 2
    got = np.load(x_npy)
    if got.shape != want.shape or got.dtype != np.float32:
        print(f"logits: got {got.dtype} {got.shape}, want float32 {want.shape}")
        return 1
    d = float(np.abs(got.astype(np.float64) - want).max())
    rel = d / float(np.abs(want).max())
    print(f"logits      max|diff| {d:.3e}  max|ref| {np.abs(want).max():.3f}  rel {rel:.3e}  "
          f"argmax agree {np.mean(got.argmax(-1) == want.argmax(-1)) * 100:.1f}%")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    ok = rel <= TOL
    print(f"{'PASS' if ok else 'FAIL'}: worst relative difference {rel:.3e} (tolerance {TOL:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
