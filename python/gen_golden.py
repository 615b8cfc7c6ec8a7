#!/usr/bin/env python3
"""Regenerates every committed model fixture under tests/data/fixtures/ (one command):

    python/.venv/bin/python python/gen_golden.py            # all fixtures
    python/.venv/bin/python python/gen_golden.py --only tiny

Per fixture <name>/:
  hf/config.json, hf/model.safetensors, hf/generation_config.json   exactly what
        DeepseekV4ForCausalLM.save_pretrained(dir, safe_serialization=True) writes
  hf/mtp.safetensors     the MTP block (HF has none) under official names mtp.0.*
  official/config.json, official/model.safetensors                 FP8/FP4 official layout
  ref.safetensors        reference tensors (names in di_ref/dump.py)
  meta.json              seeds, versions, checks and statistics

The procedure is spec §6.3/§6.4: build, randomise, round to bf16, verify rope tables, pick input ids
whose indexer/router top-k decisions are not near-ties, full forward with hooks, streaming check,
greedy generate, save, reload-and-compare.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import platform
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DeepseekV4ForCausalLM  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl  # noqa: E402

from di_ref import GENERATOR_VERSION, dump, hf, official, tiny  # noqa: E402
from di_ref import model as spec_model  # noqa: E402

REPO = os.path.dirname(HERE)
OUT_DEFAULT = os.path.join(REPO, "tests", "data", "fixtures")

# Top-k near-tie thresholds (spec §6.3 step 8) live in di_ref/hf.py.
INDEXER_GAP_MIN = hf.INDEXER_GAP_MIN
ROUTER_GAP_MIN = hf.ROUTER_GAP_MIN
# Greedy generation: smallest top1 - top2 logit margin allowed along the generated tokens.
ARGMAX_MARGIN_MIN = 1e-4
# Streaming (prefill -> decode -> prefill) vs full forward, FP32 noise bound (spec §6.3 step 6).
STREAM_TOL = 1e-4
MAX_DATA_TRIES = 400
# di_ref/model.py (the spec, implemented independently) vs HF: relative to max |ref|.
SPEC_MODEL_TOL = 1e-4

FIXTURES = {
    "tiny": dict(
        preset="tiny", seed=1, data_seed=1000, T=64, dtype="bf16", gen=(21, 48),
        what="spec §6.2 config exactly; swiglu_limit tuned so 10-30 % of gate/up values clamp; "
        "hash routing on a CSA layer (layer 1: compressed_sparse_attention + hash_moe)",
    ),
    "tiny_limit10": dict(
        preset="tiny_limit10", seed=2, data_seed=2000, T=32, dtype="f32", gen=None,
        what="smaller variant with swiglu_limit 10.0 (clamp practically inactive); "
        "the one fixture whose hf/ weights are stored FP32",
    ),
    "hca128": dict(
        preset="hca128", seed=3, data_seed=3000, T=320, dtype="bf16", gen=(99, 48),
        what="HCA ratio 128, T=320 closes two 128-windows; sliding_window 16; generation crosses "
        "position 128 during decode",
    ),
    "topk": dict(
        preset="topk", seed=4, data_seed=4000, T=96, dtype="bf16", gen=None,
        what="index_topk 2: the indexer's top-k is active from position 11 on (most queries); "
        "three CSA layers",
    ),
    "pro_like": dict(
        preset="pro_like", seed=5, data_seed=5000, T=64, dtype="bf16", gen=None,
        what="V4-Pro-like schedule: HCA, HCA, then CSA/HCA alternating, no SWA in the main stack, "
        "hash routing on layers 0-2 (layer 2 is CSA), MTP SWA",
    ),
}


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def versions() -> dict:
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "modeling_deepseek_v4_sha256": sha256(mdl.__file__),
        "configuration_deepseek_v4_sha256": sha256(
            os.path.join(os.path.dirname(mdl.__file__), "configuration_deepseek_v4.py")
        ),
    }


gaps_ok = hf.gaps_ok


def key_patterns(keys: list[str]) -> list[str]:
    """Collapse layer and expert indices: model.layers.{l}.ffn.experts.{e}.w1.weight."""
    import re

    out = []
    for k in keys:
        p = re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.{l}.", k)
        p = re.sub(r"\.experts\.\d+\.", ".experts.{e}.", p)
        if p not in out:
            out.append(p)
    return sorted(out)


def build_official(cfg, seed, model, mtp):
    off_sd = tiny.official_state_dict(model, mtp)
    stored = official.quantise(off_sd)
    deq = official.dequantise(stored)
    omodel, omtp = tiny.build(cfg, seed)  # same structure; every tensor is overwritten below
    tiny.load_official_into_(omodel, omtp, deq)
    # Non-quantised tensors must come back bit-exact; quantised ones within the format's error.
    err = {"fp8_max_rel": 0.0, "fp4_max_rel": 0.0, "exact": 0}
    for n, v in off_sd.items():
        k = official._kind(n)
        if k in ("fp8", "fp4"):
            r = float((deq[n] - v.float()).abs().max() / v.float().abs().max())
            err[k + "_max_rel"] = max(err[k + "_max_rel"], r)
        else:
            assert torch.equal(deq[n].to(v.dtype), v), n
            err["exact"] += 1
    counts = {}
    for n, (dt, _t) in stored.items():
        counts[dt] = counts.get(dt, 0) + 1
    return omodel, omtp, stored, {"weight_error": err, "stored_dtype_counts": counts}


def save_hf(model, mtp, cfg_dtype: str, d: str) -> dict:
    """save_pretrained + mtp.safetensors; reload with from_pretrained and compare every tensor."""
    m = copy.deepcopy(model)
    t = copy.deepcopy(mtp)
    if cfg_dtype == "bf16":
        m = m.to(torch.bfloat16)
        t = t.to(torch.bfloat16)
    m.save_pretrained(d, safe_serialization=True)
    mtp_sd = tiny.mtp_official_state_dict(t)
    dump.write_safetensors(os.path.join(d, "mtp.safetensors"), mtp_sd, metadata={"format": "pt"})
    keys = dump.safetensors_keys(os.path.join(d, "model.safetensors"))
    names = sorted(k for k, _, _ in keys)
    dtypes = sorted({dt for _, dt, _ in keys})
    # Reload through HF's own loader (conversion mapping included) and compare with the original.
    re = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    orig = model.state_dict()
    bad = []
    for k, v in re.state_dict().items():
        if "inv_freq" in k:
            continue
        if not torch.equal(v.float() if v.is_floating_point() else v, orig[k].float() if orig[k].is_floating_point() else orig[k]):
            bad.append(k)
    del re
    mk = sorted(mtp_sd)
    return {
        "model.safetensors": {
            "n_tensors": len(names),
            "dtypes": dtypes,
            "first_10_keys_sorted": names[:10],
            "key_patterns": key_patterns(names),
        },
        "mtp.safetensors": {"n_tensors": len(mk), "first_10_keys_sorted": mk[:10], "key_patterns": key_patterns(mk)},
        "hf_reload_mismatched_tensors": bad,
    }


def search_ids(model, mtp, omodel, omtp, T, V, seed0, log):
    """First data seed >= seed0 whose HF and official references have no top-k near-ties."""
    for k in range(MAX_DATA_TRIES):
        ids = tiny.random_ids(T, V, seed0 + k)
        ref, st = hf.reference(model, mtp, ids)
        if not gaps_ok(st):
            continue
        oref, ost = hf.reference(omodel, omtp, ids)
        if not gaps_ok(ost):
            continue
        log(f"  data seed {seed0 + k} after {k + 1} tries: indexer gap {st['indexer_min_topk_gap']}, "
            f"router gap {st['router_min_topk_gap']}; official {ost['indexer_min_topk_gap']}, {ost['router_min_topk_gap']}")
        return seed0 + k, k + 1, ids, ref, st, oref, ost
    raise RuntimeError("no data seed without top-k near-ties found")


def search_generation(model, mtp, P, N, V, seed0, log):
    for k in range(MAX_DATA_TRIES):
        prompt = tiny.random_ids(P, V, seed0 + k)
        new, margin = hf.greedy_generate(model, prompt, N)
        if margin is None or margin < ARGMAX_MARGIN_MIN:  # EOS / early stop, or a near-tie
            continue
        # The decisions along the generated sequence must not be near-ties either.
        _r, st = hf.reference(model, mtp, torch.cat([prompt, new]))
        if not gaps_ok(st):
            continue
        log(f"  prompt seed {seed0 + k} after {k + 1} tries: margin {margin:.3g}, {len(set(new.tolist()))} distinct tokens")
        return seed0 + k, k + 1, prompt, new, margin, st
    raise RuntimeError("no prompt without near-ties found")


def spec_model_check(hf_cfg: dict, weights: dict, ref: dict, clamp: bool) -> dict:
    """Run di_ref/model.py (written from the spec text) on the same weights and inputs."""
    out = spec_model.SpecModel(hf_cfg, weights, shared_expert_clamp=clamp).forward(ref["input_ids"].long())

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    res = {"logits": rel(out["logits"], ref["logits"]), "mtp_logits": rel(out["mtp_logits"], ref["mtp_logits"])}
    res["layer_out_max"] = max(rel(out[k], ref[k]) for k in ref if k.startswith("layer_out."))
    res["attn_out_max"] = max(rel(out[k], ref[k]) for k in ref if k.startswith("attn_out."))
    mism = 0
    for k in ref:
        if k.startswith("indexer_topk."):
            for t, row in enumerate(ref[k].tolist()):
                mism += out[k][t] != [v for v in row if v >= 0]
    res["indexer_rows_differing"] = mism
    worst = max(res["logits"], res["mtp_logits"], res["layer_out_max"], res["attn_out_max"])
    assert worst < SPEC_MODEL_TOL and mism == 0, res
    return res


def make_fixture(name: str, spec: dict, out_root: str, facts: dict, log) -> dict:
    t0 = time.time()
    log(f"[{name}] {spec['what']}")
    cfg = tiny.make_config(spec["preset"], **spec.get("overrides", {}))
    seed, T, V = spec["seed"], spec["T"], cfg.vocab_size
    model, mtp = tiny.build(cfg, seed)
    rope = hf.check_rope_tables(model)
    omodel, omtp, stored, off_info = build_official(cfg, seed, model, mtp)

    data_seed, tries, ids, ref, st, oref, ost = search_ids(model, mtp, omodel, omtp, T, V, spec["data_seed"], log)

    # Streaming: prefill -> decode -> prefill with the HF cache equals the full forward.
    sched = hf.stream_schedule(T)
    sl, cache_kinds = hf.streaming_logits(model, ids, sched)
    stream_diff = float((sl - ref["logits"]).abs().max())
    log(f"  streaming max |diff| {stream_diff:.3g} over {len(sched)} calls")
    assert stream_diff < STREAM_TOL, stream_diff

    # Causality: changing the second half of the input must not move the first half's outputs.
    ids2 = ids.clone()
    ids2[T // 2 :] = tiny.random_ids(T - T // 2, V, data_seed + 777)
    with torch.no_grad():
        l2 = model(ids2[None], use_cache=False).logits[0]
    causal_diff = float((l2[: T // 2] - ref["logits"][: T // 2]).abs().max())
    assert causal_diff < 1e-5, causal_diff

    tensors = dict(ref)
    tensors["official_logits"] = oref["logits"]
    tensors["official_mtp_logits"] = oref["mtp_logits"]
    gen_info = None
    if spec.get("gen"):
        P, N = spec["gen"]
        pseed, ptries, prompt, new, margin, gst = search_generation(model, mtp, P, N, V, spec["data_seed"] + 500, log)
        tensors["gen_prompt"] = prompt.to(torch.int32)
        tensors["gen_tokens"] = new.to(torch.int32)
        gen_info = {
            "prompt_seed": pseed, "prompt_seed_tries": ptries, "prompt_len": P, "n_new": N,
            "do_sample": False, "eos_token_id": int(model.config.eos_token_id), "eos_in_gen_tokens": False,
            "min_top1_top2_margin": margin, "distinct_new_tokens": len(set(new.tolist())),
            "checked_equal_to_teacher_forced_argmax": True,
            "indexer_min_topk_gap": gst["indexer_min_topk_gap"], "router_min_topk_gap": gst["router_min_topk_gap"],
        }

    d = os.path.join(out_root, name)
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    files = save_hf(model, mtp, spec["dtype"], os.path.join(d, "hf"))
    assert not files["hf_reload_mismatched_tensors"], files["hf_reload_mismatched_tensors"]
    with open(os.path.join(d, "hf", "config.json")) as f:
        hf_cfg = json.load(f)
    official.write(os.path.join(d, "official"), hf_cfg, stored)
    clamp = facts["shared_expert_clamp"]["shared_expert_clamped"]
    spec_chk = spec_model_check(hf_cfg, tiny.official_state_dict(model, mtp), ref, clamp)
    oref_full = dict(oref)
    spec_chk_off = spec_model_check(hf_cfg, official.dequantise(stored), oref_full, clamp)
    log(f"  spec model vs HF: {spec_chk}; official: logits {spec_chk_off['logits']:.3g}")
    rd, _ = dump.read_safetensors(os.path.join(d, "official", "model.safetensors"))
    assert set(rd) == set(stored)
    okeys = sorted(rd)
    files["official/model.safetensors"] = {
        "n_tensors": len(okeys), "dtype_counts": off_info["stored_dtype_counts"],
        "first_10_keys_sorted": okeys[:10], "key_patterns": key_patterns(okeys),
    }
    dump.write_ref(os.path.join(d, "ref.safetensors"), tensors, GENERATOR_VERSION)

    L = cfg.num_hidden_layers
    csa = [l for l in range(L) if cfg.layer_types[l] == tiny.CSA]
    meta = {
        "generator": f"{GENERATOR_VERSION} (python/gen_golden.py)",
        "fixture": name,
        "description": spec["what"],
        "seed": seed,
        "data_seed": data_seed,
        "data_seed_tries": tries,
        "T": T,
        "hf_weights_dtype": {"bf16": "bfloat16", "f32": "float32"}[spec["dtype"]],
        "weights_bf16_representable": True,
        "config": tiny.config_summary(cfg),
        "layers": {
            "csa": csa,
            "hca": [l for l in range(L) if cfg.layer_types[l] == tiny.HCA],
            "swa": [l for l in range(L) if cfg.layer_types[l] == tiny.SWA],
            "hash_moe": [l for l in range(L) if cfg.mlp_layer_types[l] == "hash_moe"],
            "hash_routing_on_csa_layers": [l for l in csa if cfg.mlp_layer_types[l] == "hash_moe"],
            "mtp": {"layer_type": tiny.SWA, "mlp_layer_type": "moe", "n_blocks": 1},
        },
        "versions": versions(),
        "attn_implementation": "eager",
        "experts_implementation": "eager",
        "shared_expert_clamp": facts["shared_expert_clamp"],
        "swiglu_clamp_fraction": {
            "all": st["clamp_fraction"], "routed": st["clamp_fraction_routed"], "shared": st["clamp_fraction_shared"],
            "gate": st["clamp_fraction_gate"], "up": st["clamp_fraction_up"],
            "note": "fraction of gate (> L) and up (|.| > L) values clamped, main stack + MTP, reference sequence",
        },
        "streaming_check": {"schedule": sched, "max_abs_diff": stream_diff, "tolerance": STREAM_TOL,
                            "hf_cache_layer_classes": cache_kinds},
        "causality_check_max_abs_diff": causal_diff,
        "indexer": {
            "min_topk_gap": st["indexer_min_topk_gap"],
            "official_min_topk_gap": ost["indexer_min_topk_gap"],
            "threshold": INDEXER_GAP_MIN,
            "queries_with_topk_active": st["indexer_queries_topk_active"],
            "queries_total": st["indexer_queries_total"],
        },
        "router": {
            "min_topk_gap": st["router_min_topk_gap"],
            "official_min_topk_gap": ost["router_min_topk_gap"],
            "threshold": ROUTER_GAP_MIN,
            "decisions": st["router_decisions"],
        },
        "stats": {k: st[k] for k in ("logits_abs_max", "logits_std", "mtp_logits_abs_max", "mtp_logits_std",
                                     "layer_out_abs_max", "attn_out_abs_max")},
        "spec_model_check": {
            "what": "python/di_ref/model.py, written from the spec text, on the same weights: max |diff| / max |ref|",
            "hf_weights": spec_chk,
            "official_weights": spec_chk_off,
            "tolerance": SPEC_MODEL_TOL,
        },
        "official": {
            **off_info,
            "logits_max_abs_diff_vs_hf": float((oref["logits"] - ref["logits"]).abs().max()),
            "mtp_logits_max_abs_diff_vs_hf": float((oref["mtp_logits"] - ref["mtp_logits"]).abs().max()),
            "logits_abs_max": float(oref["logits"].abs().max()),
            "fp8_scale_rule": "2^ceil_log2(fl32(amax * fl32(1/448))) per 128x128 block, amax floor 1e-4",
            "fp4_scale_rule": "2^ceil_log2(fl32(amax * fl32(1/6))) per 1x32 block, amax floor 6*2^-126",
            "fp4_packing": "int8 [out, in/2], low nibble = even input index",
        },
        "generation": gen_info,
        "rope": rope,
        "files": files,
        "ref_tensors": sorted(tensors),
    }
    sizes = {}
    for root, _dirs, fs in os.walk(d):
        for f in fs:
            p = os.path.join(root, f)
            sizes[os.path.relpath(p, d)] = os.path.getsize(p)
    meta["file_sizes"] = dict(sorted(sizes.items()))
    meta["total_bytes"] = sum(sizes.values())
    dump.write_json(os.path.join(d, "meta.json"), meta)
    log(f"  wrote {d}: {meta['total_bytes'] / 1e6:.2f} MB in {time.time() - t0:.1f} s; clamp {st['clamp_fraction']:.3f}; "
        f"|logits| max {st['logits_abs_max']:.3g}; official vs hf {meta['official']['logits_max_abs_diff_vs_hf']:.3g}")
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="fixture names (default: all)")
    ap.add_argument("--out", default=OUT_DEFAULT)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    names = a.only or list(FIXTURES)
    for n in names:
        if n not in FIXTURES:
            ap.error(f"unknown fixture {n}; known: {', '.join(FIXTURES)}")

    def log(s):
        print(s, flush=True)

    facts = {"shared_expert_clamp": hf.shared_expert_clamp(), "quant_self_test": official.self_test()}
    log(f"transformers {transformers.__version__}, torch {torch.__version__}; shared expert clamp: "
        f"{facts['shared_expert_clamp']['shared_expert_clamped']}")
    os.makedirs(a.out, exist_ok=True)
    total = 0
    for n in names:
        total += make_fixture(n, FIXTURES[n], a.out, facts, log)["total_bytes"]
    log(f"done: {total / 1e6:.2f} MB written for {len(names)} fixture(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
