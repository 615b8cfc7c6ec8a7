#!/usr/bin/env python3
"""DSpark fixture from R-OFF (DeepSeek's official V4.1 inference code on CPU, spec §0.1 / §7.2):

    python/.venv/bin/python python/gen_dspark_v41.py

R-OFF is not in this repository. It is the `tenstorrent/tt-metal` vendored copy
(`models/demos/deepseek_v3_d_p/reference/deepseek_v41/`: model.py = upstream inference/model.py at
dba1be0a40aa45a94ad051997016db3960a90277 except four import lines, engram.py, kernel_cpu.py = CPU
ports of the TileLang kernels), placed by hand under the git-ignored `python/.ref_off/deepseek_v41/`
(sha256 of each file below; `vision.py` / `image_processor.py` are local placeholders: the text path
never builds the vision tower). See docs/reference-tooling.md "DSpark fixture".

The model is spec §7.2's tiny config with one DSpark block (block size 2, target layers [4, 5],
Markov rank 32, noise token 511). Backbone weights are exactly the `v41_tiny` fixture's official
checkpoint (so R-OFF and R-HF can be compared on the same values); the `mtp.0.*` DSpark block is drawn
here (seeded) in checkpoint formats. Run under bf16 default dtype like upstream generate.py:
prefill of v41_tiny's 64 input ids at position 0 (+ the DSpark ring seeding), then 8 greedy
single-token decode steps, each followed by `forward_spec` (anchor = the target's argmax).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
REF_OFF = os.path.join(HERE, ".ref_off")
sys.path.insert(0, REF_OFF)

import torch  # noqa: E402

from di_ref import dump, official  # noqa: E402

REPO = os.path.dirname(HERE)
FIX = os.path.join(REPO, "tests", "data", "fixtures")
GENERATOR = "di_ref v41 1 (python/gen_dspark_v41.py)"
TT_METAL = {"repo": "tenstorrent/tt-metal", "dir": "models/demos/deepseek_v3_d_p/reference/deepseek_v41",
            "model.py": "702412b85f1b8d93a8e87fe0584fa165766f38ce",
            "engram.py": "702412b85f1b8d93a8e87fe0584fa165766f38ce",
            "kernel_cpu.py": "b2ee7540c83c2957b3268b0d1095b39e2b75473b"}
# Character counts of the tt-metal files as read (sha256 is computed and recorded at run time).
R_OFF_CHARS = {"model.py": 61957, "engram.py": 8439, "kernel_cpu.py": 12725}
SEED = 41
N_DECODE = 8


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class StubTokenizer:
    """Compressed map id div 2 (token 2k -> "w{k}", 2k+1 -> " W{k}", which normalise alike)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.backend_tokenizer = self

    def __len__(self):
        return self.vocab_size

    def decode(self, ids, skip_special_tokens=False):
        (t,) = ids
        return f"w{t // 2}" if t % 2 == 0 else f" W{t // 2}"

    def id_to_token(self, t):
        return self.decode([t])


def model_args(roff, off_cfg: dict):
    c = off_cfg
    return roff.ModelArgs(
        max_batch_size=1, max_seq_len=128, temperature=0.0, dtype="fp8", expert_dtype="fp4",
        vocab_size=c["vocab_size"], dim=c["dim"], moe_inter_dim=c["moe_inter_dim"], n_layers=c["n_layers"],
        n_mtp_layers=1, n_heads=c["n_heads"], n_routed_experts=c["n_routed_experts"],
        n_shared_experts=c["n_shared_experts"], n_activated_experts=c["n_activated_experts"],
        score_func=c["score_func"], gate_temp=c["gate_temp"], route_scale=c["route_scale"],
        swiglu_limit=c["swiglu_limit"], q_lora_rank=c["q_lora_rank"], head_dim=c["head_dim"],
        rope_head_dim=c["rope_head_dim"], norm_eps=c["norm_eps"], o_groups=c["o_groups"],
        o_lora_rank=c["o_lora_rank"], window_size=c["window_size"],
        compress_ratios=tuple(c["compress_ratios"]) + (0,), kv_source_layers=tuple(c["kv_source_layers"]),
        index_source_layers=tuple(c["index_source_layers"]), compress_rope_theta=c["compress_rope_theta"],
        original_seq_len=c["original_seq_len"], rope_theta=c["rope_theta"], rope_factor=c["rope_factor"],
        beta_fast=c["beta_fast"], beta_slow=c["beta_slow"], index_n_heads=c["index_n_heads"],
        index_head_dim=c["index_head_dim"], index_topk=c["index_topk"],
        candidate_source_layer=c["candidate_source_layer"], candidate_topk_blocks=c["candidate_topk_blocks"],
        candidate_block_size=c["candidate_block_size"], hc_mult=c["hc_mult"],
        hc_sinkhorn_iters=c["hc_sinkhorn_iters"], hc_eps=c["hc_eps"],
        engram_layer_ids=tuple(c["engram_layer_ids"]), engram_num_embeddings=tuple(c["engram_num_embeddings"]),
        engram_max_ngram_size=c["engram_max_ngram_size"], engram_vocab_size=c["engram_vocab_size"],
        engram_n_heads=c["engram_n_heads"], engram_head_dim=c["engram_head_dim"], engram_pad_id=c["engram_pad_id"],
        engram_compressed_vocab_size=c["engram_compressed_vocab_size"],
        dspark_block_size=2, dspark_noise_token_id=c["vocab_size"] - 1, dspark_target_layer_ids=(4, 5),
        dspark_markov_rank=32,
    )


def dspark_stored(model, g: torch.Generator) -> dict:
    """Seeded mtp.0.* tensors in checkpoint formats (spec §3.5 / §6.2)."""
    out = {}
    params = dict(model.named_parameters())

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    for name, p in params.items():
        if not name.startswith("mtp.") or name.endswith(".scale"):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        leaf_owner = base.rsplit(".", 1)[-1]
        if p.dtype == torch.float8_e4m3fn:
            w = randn(*p.shape) * p.shape[1] ** -0.5
            c, s = official.quant_fp8_block(w, 32)
            out[name], out[base + ".scale"] = ("F8_E4M3", c), ("F8_E8M0", s)
        elif p.dtype == torch.float4_e2m1fn_x2:
            w = randn(p.shape[0], 2 * p.shape[1]) * (2 * p.shape[1]) ** -0.5
            pk, s = official.quant_fp4_rows(w)
            out[name], out[base + ".scale"] = ("I8", pk), ("F8_E8M0", s)
        elif name.endswith("attn.wo_a.weight"):  # bf16 at run time, FP8 in the checkpoint
            w = randn(*p.shape) * p.shape[1] ** -0.5
            c, s = official.quant_fp8_block(w, 32)
            out[name], out[base + ".scale"] = ("F8_E4M3", c), ("F8_E8M0", s)
        elif "norm" in leaf_owner and name.endswith(".weight"):
            out[name] = ("BF16", (1.0 + 0.1 * randn(*p.shape)).bfloat16())
        elif name.endswith("attn_sink"):
            out[name] = ("F32", randn(*p.shape).bfloat16().float())
        elif "hc_" in name:
            if name.endswith("_fn"):
                t = randn(*p.shape) * 0.0625
            elif name.endswith("_base"):
                t = 0.5 * randn(*p.shape)
            else:
                t = 1.0 + 0.2 * randn(*p.shape)
            out[name] = ("F32", t.bfloat16().float())
        elif name.endswith("ffn.gate.bias"):
            out[name] = ("F32", (0.1 * randn(*p.shape)).bfloat16().float())
        elif p.dim() >= 2:
            out[name] = ("BF16", (randn(*p.shape) * p.shape[-1] ** -0.5).bfloat16())
        else:
            raise AssertionError(f"unhandled DSpark parameter {name} {p.dtype} {tuple(p.shape)}")
    return out


def load_(model, stored: dict) -> list[str]:
    """Official-layout tensors -> R-OFF parameters (storage dtypes kept; wo_a dequantised to bf16 like
    convert.py; BF16-stored FP32 parameters widened). Returns the file keys R-OFF has no parameter for."""
    params = dict(model.named_parameters())
    used = set()
    for name, p in params.items():
        assert name in stored, f"missing in checkpoint: {name}"
        dt, t = stored[name]
        used.add(name)
        if p.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2):
            assert tuple(t.shape) == tuple(p.shape), (name, t.shape, p.shape)
            p.data.view(torch.uint8).copy_(t.view(torch.uint8))
        elif dt == "F8_E4M3":  # wo_a
            p.data.copy_(official.dequant_fp8_block(t, stored[name[: -len(".weight")] + ".scale"][1], 32))
        else:
            p.data.copy_(t.float() if t.dtype != torch.bfloat16 else t)
    return sorted(k for k in stored if k not in used and not (k.endswith(".scale") and k[: -6] + ".weight" in used
                                                               and stored[k[: -6] + ".weight"][0] == "F8_E4M3"))


# ---- FP32 mode: the R-OFF model code with FP32 stand-ins for its BF16 kernels (our code) ----


def _deq(w):
    from deepseek_v41 import kernel_cpu as kc

    if w.dtype == torch.float4_e2m1fn_x2:
        return kc.unpack_fp4(w) * w.scale.float().repeat_interleave(32, 1)
    s = w.scale.float().repeat_interleave(32, 0).repeat_interleave(32, 1)[: w.shape[0], : w.shape[1]]
    return w.float() * s


def fp32_kernels(roff) -> None:
    """Replace, in model.py's namespace, `linear` (FP8/FP4 GEMM with A8 activation quant -> FP32 GEMM on
    the dequantised weight), `act_quant` / `fp4_act_quant` (in-place KV fake-quant, bf16-only -> the
    same quantise-dequantise in FP32) and `sparse_attn` (BF16 probabilities -> one FP32 softmax with the
    sink). Everything else is R-OFF's own code. This is R-HF's numerics (spec §7.3)."""
    from deepseek_v41 import kernel_cpu as kc

    def linear(x, weight, bias=None):
        assert bias is None
        if weight.dtype in (torch.float4_e2m1fn_x2, torch.float8_e4m3fn):
            return torch.nn.functional.linear(x.float(), _deq(weight))
        return torch.nn.functional.linear(x.float(), weight.float())

    def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
        assert inplace and scale_fmt is not None
        xg = x.float().unflatten(-1, (-1, block_size))
        sc = kc.fast_round_scale(xg.abs().amax(-1).clamp_min(1e-4), kc._FP8_MAX_INV)
        q = kc._to_e4m3_satfinite(xg / sc.unsqueeze(-1))
        x.copy_((q.float() * sc.unsqueeze(-1)).flatten(-2))
        return x

    def fp4_act_quant(x, block_size=32, inplace=False, scale_dtype=torch.float8_e8m0fnu):
        assert inplace
        xg = x.float().unflatten(-1, (-1, block_size))
        amax = xg.abs().amax(-1)
        if scale_dtype == torch.float8_e4m3fn:
            sc = kc._to_e4m3_satfinite(amax.clamp_min(6 * 2**-9) / 6.0).float()
        else:
            sc = kc.fast_round_scale(amax.clamp_min(6 * 2**-126), kc._FP4_MAX_INV)
        v = (xg / sc.unsqueeze(-1)).clamp(-6.0, 6.0)
        x.copy_((kc._e2m1_round(v) * sc.unsqueeze(-1)).flatten(-2))
        return x

    def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
        b, m, h, d = q.shape
        valid = topk_idxs != -1
        rows = kv[torch.arange(b).view(b, 1, 1), topk_idxs.long().clamp_min(0)].float()
        lg = torch.einsum("bmhd,bmkd->bmhk", q.float(), rows) * softmax_scale
        lg = lg.masked_fill(~valid.unsqueeze(2), float("-inf"))
        lg = torch.cat([lg, attn_sink.float().view(1, 1, h, 1).expand(b, m, h, 1)], -1)
        p = torch.softmax(lg, -1)[..., :-1]
        return torch.einsum("bmhk,bmkd->bmhd", p, rows)

    roff.linear, roff.act_quant, roff.fp4_act_quant, roff.sparse_attn = linear, act_quant, fp4_act_quant, sparse_attn


def run(roff, args, allst: dict, ids: torch.Tensor, mode: str) -> dict:
    """Prefill + N_DECODE greedy decode steps, each followed by forward_spec."""
    dt = torch.bfloat16 if mode == "bf16" else torch.float32
    with roff.set_dtype(dt):
        model = roff.Transformer(args, StubTokenizer(args.vocab_size)).eval()
    unused = load_(model, allst)
    assert all(k.endswith("ffn.gate.bias_vl") for k in unused), unused  # text-only R-OFF has no bias_vl
    assert model.engram_hash.pad_id == 1 and torch.equal(model.engram_hash.token_map, torch.arange(512) // 2)
    if mode == "fp32":
        for p in model.parameters():
            if p.dtype == torch.bfloat16:
                p.data = p.data.float()
    T = ids.numel()
    rec = {"decode_tokens": [], "decode_logits": [], "decode_main_hidden": [], "draft_ids": [], "draft_logits": [],
           "draft_confidence": []}
    with roff.set_dtype(dt):
        out_ids, logits, main_hidden = model(ids.view(1, -1), 0)
        assert model.forward_spec(out_ids, main_hidden, 0) is None  # seeds the DSpark ring
        rec["prefill_logits_last"] = logits[0].float()
        rec["prefill_main_hidden"] = main_hidden[0].float()
        tok = out_ids
        for j in range(N_DECODE):
            pos = T + j
            rec["decode_tokens"].append(int(tok[0]))
            out_ids, logits, main_hidden = model(tok.view(1, 1), pos)
            d_ids, d_logits, conf = model.forward_spec(out_ids, main_hidden, pos)
            rec["decode_logits"].append(logits[0].float())
            rec["decode_main_hidden"].append(main_hidden[0, 0].float())
            rec["draft_ids"].append(d_ids[0])
            rec["draft_logits"].append(d_logits[0].float())
            rec["draft_confidence"].append(conf[0].float())
            tok = out_ids
    out = {
        "prefill_logits_last": rec["prefill_logits_last"],
        "prefill_main_hidden": rec["prefill_main_hidden"],
        "decode_tokens": torch.tensor(rec["decode_tokens"], dtype=torch.int32),
        "decode_logits": torch.stack(rec["decode_logits"]),
        "decode_main_hidden": torch.stack(rec["decode_main_hidden"]),
        "draft_ids": torch.stack(rec["draft_ids"]).to(torch.int32),
        "draft_logits": torch.stack(rec["draft_logits"]),
        "draft_confidence": torch.stack(rec["draft_confidence"]),
    }
    return out


def crosscheck(roff, name: str) -> dict:
    """R-OFF in FP32 mode (fp32_kernels must be active) on a V4.1 fixture's official checkpoint vs that
    fixture's R-HF reference: max |d| / max |ref| of every block's output streams and attention output,
    and the last-position logits."""
    d = os.path.join(FIX, name)
    with open(os.path.join(d, "official", "config.json")) as f:
        cfg = json.load(f)
    stored, _ = dump.read_safetensors(os.path.join(d, "official", "model.safetensors"))
    ref, _ = dump.read_safetensors(os.path.join(d, "ref.safetensors"))
    ids = ref["input_ids"][1].long()
    args = model_args(roff, cfg)
    args.n_mtp_layers, args.dspark_block_size, args.compress_ratios = 0, 0, tuple(cfg["compress_ratios"])
    args.max_seq_len = max(128, 2 * ids.numel())
    with roff.set_dtype(torch.float32):
        model = roff.Transformer(args, StubTokenizer(args.vocab_size)).eval()
    unused = load_(model, stored)
    assert all(k.endswith("ffn.gate.bias_vl") for k in unused), unused
    for p in model.parameters():
        if p.dtype == torch.bfloat16:
            p.data = p.data.float()
    outs, hooks = {}, []
    for i, layer in enumerate(model.layers):
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(f"layer_out.{i}", o[0][0])))
        hooks.append(layer.attn.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(f"attn_out.{i}", o[0])))
    with roff.set_dtype(torch.float32):
        _, logits, _ = model(ids.view(1, -1), 0)
    for h in hooks:
        h.remove()
    outs["logits_last"] = logits[0]
    ref_t = {k: ref[k][1] for k in outs if k in ref}
    ref_t["logits_last"] = ref["logits"][1][-1]
    rel = {k: float((outs[k].float() - r).abs().max() / r.abs().max()) for k, r in ref_t.items()}
    worst = max(rel.values())
    print(f"R-OFF fp32 vs R-HF on {name}: worst relative difference {worst:.3e} over {len(rel)} tensors")
    return {"worst_rel": worst, "per_tensor_rel": rel}


def main() -> int:
    torch.set_num_threads(2)
    from deepseek_v41 import model as roff

    files = {}
    for f in ("model.py", "engram.py", "kernel_cpu.py"):
        p = os.path.join(REF_OFF, "deepseek_v41", f)
        with open(p) as fh:
            n = len(fh.read())
        assert n == R_OFF_CHARS[f], (f, n)
        files[f] = {"sha256": sha256(p), "chars": n, "tt_metal_commit": TT_METAL[f]}

    tiny = os.path.join(FIX, "v41_tiny")
    with open(os.path.join(tiny, "official", "config.json")) as f:
        off_cfg = json.load(f)
    stored, _ = dump.read_safetensors(os.path.join(tiny, "official", "model.safetensors"))
    ref_tiny, _ = dump.read_safetensors(os.path.join(tiny, "ref.safetensors"))
    ids = ref_tiny["input_ids"][1].long()
    T = ids.numel()

    args = model_args(roff, off_cfg)
    with roff.set_dtype(torch.bfloat16):
        proto = roff.Transformer(args, StubTokenizer(args.vocab_size))
    mtp = dspark_stored(proto, torch.Generator().manual_seed(SEED))
    del proto
    allst = dict(stored)
    allst.update(mtp)

    res = {"bf16": run(roff, args, allst, ids, "bf16")}
    kernels = {k: getattr(roff, k) for k in ("linear", "act_quant", "fp4_act_quant", "sparse_attn")}
    fp32_kernels(roff)
    try:
        res["fp32"] = run(roff, args, allst, ids, "fp32")
        cross = {n: crosscheck(roff, n) for n in ("v41_tiny", "v41_long")}
    finally:
        for k, v in kernels.items():
            setattr(roff, k, v)

    # R-OFF vs R-HF on the same weights, last prefill position (R-HF: v41_tiny ref logits).
    hf_last = ref_tiny["logits"][1][T - 1]
    cmp = {}
    for mode, r in res.items():
        d = float((r["prefill_logits_last"] - hf_last).abs().max())
        cmp[mode] = {"max_abs": d, "rel": d / float(hf_last.abs().max()),
                     "argmax_same": int(r["prefill_logits_last"].argmax()) == int(hf_last.argmax())}
        print(f"R-OFF {mode} vs R-HF (v41_tiny logits[{T - 1}]): {cmp[mode]}")
    assert cmp["fp32"]["rel"] < 1e-5, cmp
    # Draft argmax margins (top1 - top2 of the Markov-corrected logits), FP32 mode.
    top2 = res["fp32"]["draft_logits"].topk(2, dim=-1).values
    margin = float((top2[..., 0] - top2[..., 1]).min())
    print(f"fp32 draft argmax margin min {margin:.3e}")

    out = os.path.join(FIX, "v41_dspark")
    os.makedirs(os.path.join(out, "official"), exist_ok=True)
    cfg = dict(off_cfg)
    cfg.update({"n_mtp_layers": 1, "compress_ratios": list(args.compress_ratios), "dspark_block_size": 2,
                "dspark_noise_token_id": args.dspark_noise_token_id, "dspark_target_layer_ids": [4, 5],
                "dspark_markov_rank": 32, "dspark_n_routed_experts": 0, "dspark_n_activated_experts": 0,
                "max_seq_len": 128})
    dump.write_json(os.path.join(out, "official", "config.json"), cfg)
    dump.write_safetensors(os.path.join(out, "official", "mtp.safetensors"), mtp, metadata={"format": "pt"})
    # The same block dequantised (values exact in BF16), for engines that read the hf/ layout.
    os.makedirs(os.path.join(out, "hf"), exist_ok=True)
    hf_mtp = {}
    for k, (dt, t) in mtp.items():
        if k.endswith(".scale"):
            continue
        if dt == "F8_E4M3":
            v = official.dequant_fp8_block(t, mtp[k[: -len(".weight")] + ".scale"][1], 32)
        elif dt == "I8":
            v = official.dequant_fp4_rows(t, mtp[k[: -len(".weight")] + ".scale"][1])
        else:
            v = t.float()
        if dt == "F32":
            hf_mtp[k] = ("F32", v)
        else:
            assert torch.equal(v.bfloat16().float(), v), k
            hf_mtp[k] = ("BF16", v.bfloat16())
    dump.write_safetensors(os.path.join(out, "hf", "mtp.safetensors"), hf_mtp, metadata={"format": "pt"})
    ref = {"input_ids": ids.to(torch.int32)}
    for mode, r in res.items():
        for k, t in r.items():
            ref[f"{mode}.{k}"] = t
    dump.write_safetensors(os.path.join(out, "ref.safetensors"), ref, metadata={"generator": GENERATOR})
    meta = {
        "generator": GENERATOR,
        "fixture": "v41_dspark",
        "reference": "R-OFF: official inference/model.py (tt-metal vendored copy) + tt-metal kernel_cpu.py, "
        "CPU, torch default dtype bfloat16, FP8 activation quant (32-blocks, UE8M0) before every FP8/FP4 GEMM",
        "r_off_files": files,
        "r_off_source": TT_METAL,
        "backbone_weights": "tests/data/fixtures/v41_tiny/official/model.safetensors (not copied)",
        "dspark_weights": "official/mtp.safetensors (FP8/FP4 + scales), hf/mtp.safetensors (same values, "
        "BF16/F32, no scales); seed %d" % SEED,
        "T": T,
        "decode_steps": N_DECODE,
        "config": cfg,
        "r_off_vs_r_hf_last_prefill_logits": cmp,
        "fp32_draft_argmax_margin_min": margin,
        "r_off_fp32_vs_r_hf_fixtures": cross,
        "ref_tensors": {k: [str(t.dtype).replace("torch.", ""), list(t.shape)] for k, t in sorted(ref.items())},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }
    dump.write_json(os.path.join(out, "meta.json"), meta)
    print("fp32 draft ids", ref["fp32.draft_ids"].tolist())
    print("bf16 draft ids", ref["bf16.draft_ids"].tolist())
    return 0


if __name__ == "__main__":
    sys.exit(main())
