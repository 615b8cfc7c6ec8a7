#!/usr/bin/env python3
"""Regenerates the DeepSeek-V4.1 fixtures under tests/data/fixtures/ (one command):

    python/.venv/bin/python python/install_v41_reference.py --check     # R-HF V4.1 in the venv
    python/.venv/bin/python python/gen_golden_v41.py                    # all V4.1 fixtures
    python/.venv/bin/python python/gen_golden_v41.py --only v41_tiny

Per model fixture <name>/ (layout parallel to the V4 fixtures, contents in docs/reference-tooling.md):
  hf/config.json         composite HF config (model_type deepseek_v41, text_config)
  hf/model.safetensors   native checkpoint names (spec §6.4 right column), BF16 / F32, no scales
  official/config.json   flat official ModelArgs names (spec §1.1)
  official/model.safetensors  FP8 e4m3 32x32 UE8M0, FP4 experts 1x32, Engram rows FP8 1x32
  ref.safetensors        R-HF reference tensors
  meta.json              seeds, reference revision + file sha256s, config, checks
and v41_engram/engram_kat.json: Engram hash known answers (spec App. A.1 / A.2), computed by R-HF's
hashing code and checked against the appendix.

Procedure: spec §7.4 (FP32 CPU eager, Engram stub cmap[id] = id div 2, constants randomised, values on
the bf16 / FP8 / FP4 grids so hf/ and official/ hold identical values), input ids re-drawn until every
indexer top-k, candidate-block and router decision has a gap (tie-free), one-shot forward with hooks,
then chunked prefill and token-by-token decode through DynamicCache, which must reproduce the one-shot
logits within 1e-4 with identical top-k sets.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import install_v41_reference  # noqa: E402
from di_ref import dump, official  # noqa: E402
from di_ref import v41  # noqa: E402

REPO = os.path.dirname(HERE)
OUT_DEFAULT = os.path.join(REPO, "tests", "data", "fixtures")
GENERATOR = "di_ref v41 1 (python/gen_golden_v41.py)"

INDEXER_GAP_MIN = 1e-4  # indexer and candidate-block score gaps at the top-k boundary
ROUTER_GAP_MIN = 1e-5
STREAM_TOL = 1e-4
MAX_DATA_TRIES = 400

FIXTURES = {
    "v41_tiny": dict(
        preset="tiny", seed=1, data_seed=1000, T=64, chunks=[7, 6, 9, 1, 13, 28],
        what="spec §7.2/§7.4 tiny config exactly (R-HF, FP32 CPU eager); Engram on layers 0 (SWA) and 1 "
        "(m=2 KV source); m=1 candidate source 3; layer 5 reindexes inside the candidate pool",
    ),
    "v41_long": dict(
        preset="long", seed=2, data_seed=2000, T=160, chunks=[31, 6, 1, 1, 17, 64, 40], quant_abs=3e-8,
        what="T=160, window 16: 80 m=2 groups and 160 m=1 entries; index_topk 16 < visible entries for "
        "most queries; 4 candidate blocks of 8 (level 2 restricts layer 6); reindex layer 3 (m=2, no "
        "own keys); Engram on the two KV sources",
    ),
}


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def versions() -> dict:
    return {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
            "reference": install_v41_reference.status()}


def key_patterns(keys) -> list[str]:
    out = []
    for k in keys:
        p = re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.{l}.", k)
        p = re.sub(r"\.experts\.\d+\.", ".experts.{e}.", p)
        p = re.sub(r"^(layer_out|hc_pre|attn_out|cmain|kidx|topk|candidates|engram_hash)\.\d+$", r"\1.{l}", p)
        if p not in out:
            out.append(p)
    return sorted(out)


def gaps_ok(g: dict) -> bool:
    return (g["indexer"] >= INDEXER_GAP_MIN and g["candidate_blocks"] >= INDEXER_GAP_MIN
            and g["router"] >= ROUTER_GAP_MIN and g["quant_fragile"] == 0)


def topk_stats(cfg, cap, T) -> dict:
    """How active the sparse selection is: queries whose visible entries exceed index_topk, and
    queries whose candidate pool is smaller than their visible entries."""
    out = {}
    src = None
    for l in range(cfg.num_hidden_layers):
        if l in cfg.kv_source_layer_ids:
            src = l
        if l in cfg.index_source_layer_ids:
            m = cfg.compress_ratios[src]
            vis = torch.div(torch.arange(1, T + 1), m, rounding_mode="floor")
            out[f"layer{l}_queries_topk_active"] = int((vis > cfg.index_topk).sum())
    for l, c in cap["cand"].items():
        m = cfg.compress_ratios[l]
        vis = torch.div(torch.arange(1, T + 1), m, rounding_mode="floor")
        out[f"layer{l}_queries_candidates_restrict"] = int((c.sum(-1) < vis).sum())
    return out


def make_fixture(name: str, spec: dict, out_root: str, log) -> dict:
    cfg = v41.make_config(spec["preset"])
    T = spec["T"]
    log(f"[{name}] build (seed {spec['seed']})")
    model = v41.build(cfg, spec["seed"])

    v41.QUANT_SIGNIFICANT = spec.get("quant_significant", 0.0)
    v41.QUANT_ABS = spec.get("quant_abs", 1e-7)
    rejected = {"gaps": 0, "stream": 0}
    for k in range(MAX_DATA_TRIES):
        ids = v41.random_ids(T, cfg.vocab_size, spec["data_seed"] + k)
        cap = v41.run(model, ids)
        g = v41.min_gaps(cap)
        if not gaps_ok(g):
            rejected["gaps"] += 1
            continue
        log(f"[{name}] data seed {spec['data_seed'] + k}: gaps {g}")
        # Streaming: chunked prefill (split inside ratio-2 groups) and token-by-token decode.
        checks = {"gaps": g}
        streams = {}
        for label, chunks in (("chunked", spec["chunks"]), ("stepwise", [1] * T)):
            s = v41.stream(model, ids, chunks)
            d = float((s["logits"] - cap["logits"]).abs().max())
            same = {l: bool(torch.equal(s["topk"][l], cap["topk_sorted"][l])) for l in s["topk"]}
            log(f"[{name}] {label}: max|dlogit| {d:.3e}, top-k identical {same}")
            if d > STREAM_TOL or not all(same.values()):
                break
            checks[f"{label}_max_abs_diff"] = d
            checks[f"{label}_topk_identical"] = True
            streams[label] = s["logits"]
        if len(streams) == 2:
            break
        rejected["stream"] += 1
    else:
        raise SystemExit(f"[{name}] no tie-free input in {MAX_DATA_TRIES} tries")
    data_seed, tries = spec["data_seed"] + k, k + 1
    log(f"[{name}] data seed {data_seed} after {tries} tries (rejected {rejected})")
    checks["chunks"] = spec["chunks"]
    checks["rejected_data_seeds"] = rejected
    checks["quant_margin"] = {"rel": v41.QUANT_REL, "abs_of_block_max": v41.QUANT_ABS,
                              "ignored_flips_below_block_max_fraction": v41.QUANT_SIGNIFICANT}

    # Files.
    d = os.path.join(out_root, name)
    if os.path.exists(d):
        shutil.rmtree(d)
    native = v41.native_state_dict(model)
    v41.write_hf(os.path.join(d, "hf"), cfg, native)
    stored = v41.write_official(os.path.join(d, "official"), cfg, native)
    deq = v41.dequant_official(stored)
    assert set(deq) == set(native)
    for k_, v in native.items():
        assert torch.equal(deq[k_], v), f"official dequantisation differs: {k_}"
    checks["official_dequantises_to_hf_exactly"] = True
    reloaded = v41.load_dir(os.path.join(d, "hf"))
    rcap = v41.run(reloaded, ids, gaps=False)
    checks["hf_reload_max_abs_diff"] = float((rcap["logits"] - cap["logits"]).abs().max())
    assert checks["hf_reload_max_abs_diff"] == 0.0, checks["hf_reload_max_abs_diff"]

    ref = {"input_ids": ids.to(torch.int32), "logits": cap["logits"], "logits_chunked": streams["chunked"],
           "chunk_lens": torch.tensor(spec["chunks"], dtype=torch.int32), "logits_stepwise": streams["stepwise"],
           "engram_cmap": v41.cmap(cfg).to(torch.int32)}
    for l in range(cfg.num_hidden_layers):
        ref[f"layer_out.{l}"] = cap["layer_out"][l].float()
        ref[f"hc_pre.{l}"] = cap["hc_pre"][l].float()
        ref[f"attn_out.{l}"] = cap["attn_out"][l].float()
    for l in cap["cmain"]:
        ref[f"cmain.{l}"] = cap["cmain"][l].float()
        ref[f"kidx.{l}"] = cap["kidx"][l].float()
    for l, t in cap["topk_sorted"].items():
        ref[f"topk.{l}"] = t.to(torch.int32)
    for l, c in cap["cand"].items():
        ref[f"candidates.{l}"] = c.to(torch.int32)
    for k_, l in enumerate(cfg.engram_layer_ids):
        ref[f"engram_hash.{l}"] = cap["hash"][:, k_, :].to(torch.int32)
    dump.write_safetensors(os.path.join(d, "ref.safetensors"), ref, metadata={"generator": GENERATOR})

    files = {}
    total = 0
    for rel in ("hf/config.json", "hf/model.safetensors", "official/config.json", "official/model.safetensors",
                "ref.safetensors"):
        p = os.path.join(d, rel)
        files[rel] = {"bytes": os.path.getsize(p), "sha256": sha256(p)}
        total += os.path.getsize(p)
    ref_index = {k_: [str(t.dtype).replace("torch.", ""), list(t.shape)] for k_, t in sorted(ref.items())}
    meta = {
        "generator": GENERATOR,
        "fixture": name,
        "description": spec["what"],
        "seed": spec["seed"],
        "data_seed": data_seed,
        "data_seed_tries": tries,
        "T": T,
        "reference": "R-HF: transformers DeepseekV41ForCausalLM, FP32, CPU, eager attention, eager experts, "
        "use_cache=False for the one-shot run",
        "engram_stub": {"cmap": "id div 2 (ref.safetensors engram_cmap)",
                        "pad_id_compressed": int(v41.cmap(cfg)[cfg.engram_pad_id])},
        "config": {k_: v for k_, v in cfg.to_dict().items() if k_ not in ("transformers_version",)},
        "hash_tables": {
            "primes": model.model.engram_hash_state.primes.tolist(),
            "offsets": model.model.engram_hash_state.offsets.tolist(),
            "multipliers": model.model.engram_hash_state.multipliers.tolist(),
        },
        "rope": {
            "main_inv_freq": model.model.rotary_emb.main_inv_freq.tolist(),
            "compress_inv_freq": model.model.rotary_emb.compress_inv_freq.tolist(),
            "main_attention_scaling": model.model.rotary_emb.main_attention_scaling,
            "compress_attention_scaling": model.model.rotary_emb.compress_attention_scaling,
        },
        "checks": checks,
        "topk_stats": topk_stats(cfg, cap, T),
        "versions": versions(),
        "files": files,
        "ref_tensors": ref_index,
        "hf_keys": key_patterns(native),
        "official_keys": key_patterns(stored),
        "total_bytes": total,
    }
    dump.write_json(os.path.join(d, "meta.json"), meta)
    log(f"[{name}] wrote {total / 1e6:.2f} MB; topk stats {meta['topk_stats']}")
    return meta


# ---- Engram hash known answers (spec App. A) ----

A1 = {
    "primes": [
        [[16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183],
         [16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321],
         [16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463]],
        [[16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627],
         [16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769],
         [16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889]],
    ],
    "multipliers": [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
                    [67716810739261, 51510806800915, 30921347202721, 82619226485591]],
    "num_embeddings": [384006168, 384016682],
}
A2 = {
    "primes": [[[101, 103], [107, 109], [113, 127]], [[131, 137], [139, 149], [151, 157]]],
    "multipliers": [[22948963341361471, 9720090748611819, 1476226777048821, 595470825660793],
                    [29662608052400909, 1873410163432121, 13919202536988139, 28638879857136817]],
    "num_embeddings": [660, 864],
    # (engram layer index, position) -> row ids; token ids [10, 14, 18, 22, 3]
    "rows": {(0, 0): [43, 135, 218, 388, 510, 582], (0, 3): [75, 182, 302, 347, 473, 640],
             (0, 4): [22, 152, 297, 316, 532, 643], (1, 0): [102, 260, 371, 416, 559, 859],
             (1, 3): [24, 214, 280, 459, 648, 821], (1, 4): [7, 249, 294, 529, 587, 829]},
    "dead_pos2_layer0_pos3": [52, 121, 283, 402, 448, 545],
}


def _hash_state(cfg, token_map, pad_id):
    hs = v41.mdl.DeepseekV41NgramHashState(cfg)
    hs.token_map = token_map
    hs.pad_id = pad_id
    return hs


def _hash(hs, ids, mask=None, cfg=None, chunks=None):
    """[T] ids -> [T, L, cols] row ids; with `chunks`, through a cache (history across calls)."""
    with torch.no_grad():
        if chunks is None:
            return hs(ids.view(1, -1), None if mask is None else mask.view(1, -1), None)[0]
        cache = transformers.cache_utils.Cache(layers=[v41.mdl.DeepseekV41CSACache(cfg)])
        outs, p = [], 0
        for n in chunks:
            m = None if mask is None else mask[p:p + n].view(1, -1)
            outs.append(hs(ids[p:p + n].view(1, -1), m, cache)[0])
            p += n
        return torch.cat(outs)


def make_engram_kat(out_root: str, log) -> dict:
    cases = {}
    # A.2: tiny config, stub map.
    cfg = v41.make_config("tiny")
    hs = _hash_state(cfg, v41.cmap(cfg), int(v41.cmap(cfg)[cfg.engram_pad_id]))
    assert hs.primes.tolist() == A2["primes"], hs.primes.tolist()
    assert hs.multipliers.tolist() == A2["multipliers"], hs.multipliers.tolist()
    assert [sum(p for per in layer for p in per) for layer in hs.primes.tolist()] == A2["num_embeddings"]
    ids = torch.tensor([10, 14, 18, 22, 3])
    rows = _hash(hs, ids)
    for (L, pos), want in A2["rows"].items():
        assert rows[pos, L].tolist() == want, (L, pos, rows[pos, L].tolist(), want)
    dead = torch.tensor([True, True, False, True, True])
    rows_dead = _hash(hs, ids, dead)
    assert rows_dead[3, 0].tolist() == A2["dead_pos2_layer0_pos3"], rows_dead[3, 0].tolist()
    log("[v41_engram] spec App. A.2 (tiny) reproduced: primes, multipliers, row ids, DEAD case")
    g = torch.Generator().manual_seed(4242)
    long_ids = torch.randint(0, cfg.vocab_size, (40,), generator=g)
    long_rows = _hash(hs, long_ids)
    chunked = _hash(hs, long_ids, cfg=cfg, chunks=[1, 2, 5, 13, 19])
    assert torch.equal(long_rows, chunked)
    tiny_case = {
        "config": {k: getattr(cfg, k) for k in ("engram_layer_ids", "engram_vocab_size", "engram_max_ngram_size",
                                                "engram_n_heads", "engram_num_embeddings", "engram_pad_id",
                                                "engram_compressed_vocab_size")},
        "cmap": "id div 2", "pad_compressed_id": hs.pad_id,
        "primes": hs.primes.tolist(), "offsets": hs.offsets.tolist(), "multipliers": hs.multipliers.tolist(),
        "cases": [
            {"token_ids": ids.tolist(), "dead": None, "row_ids": rows.tolist()},
            {"token_ids": ids.tolist(), "dead": (~dead).tolist(), "row_ids": rows_dead.tolist()},
            {"token_ids": long_ids.tolist(), "dead": None, "row_ids": long_rows.tolist(),
             "note": "identical when fed in chunks 1+2+5+13+19 through a cache (history across calls)"},
        ],
    }
    cases["tiny"] = tiny_case

    # A.1: released Flash constants (identity compressed map: the real map needs the V4.1 tokenizer).
    fcfg = v41.DeepseekV41TextConfig(engram_layer_ids=[1, 14], engram_num_embeddings=[384006168, 384016682])
    ident = torch.arange(fcfg.engram_compressed_vocab_size, dtype=torch.long)
    fhs = _hash_state(fcfg, ident, 2)
    assert fhs.primes.tolist() == A1["primes"], fhs.primes.tolist()
    assert fhs.multipliers.tolist() == A1["multipliers"], fhs.multipliers.tolist()
    assert [sum(p for per in layer for p in per) for layer in fhs.primes.tolist()] == A1["num_embeddings"]
    assert fhs.offsets[0, 1:].tolist()[:2] == [16000057, 32000136] and fhs.offsets[0, -1] == 368005705
    assert fhs.offsets[1, 1:].tolist()[:1] == [16000477] and fhs.offsets[1, -1] == 368015793
    log("[v41_engram] spec App. A.1 (released Flash) reproduced: primes, multipliers, offsets, row totals")
    g = torch.Generator().manual_seed(99092)
    cids = torch.randint(0, 99092, (24,), generator=g)
    cids[:4] = torch.tensor([0, 1, 2, 99091])
    fdead = torch.ones(24, dtype=torch.bool)
    fdead[10] = False
    cases["flash"] = {
        "config": {k: getattr(fcfg, k) for k in ("engram_layer_ids", "engram_vocab_size", "engram_max_ngram_size",
                                                 "engram_n_heads", "engram_num_embeddings", "engram_pad_id",
                                                 "engram_compressed_vocab_size")},
        "cmap": "identity (inputs are compressed ids); pad compressed id taken as 2 (cmap[2] unknown without "
        "the V4.1 tokenizer)",
        "pad_compressed_id": 2,
        "primes": fhs.primes.tolist(), "offsets": fhs.offsets.tolist(), "multipliers": fhs.multipliers.tolist(),
        "cases": [
            {"token_ids": cids.tolist(), "dead": None, "row_ids": _hash(fhs, cids).tolist()},
            {"token_ids": cids.tolist(), "dead": (~fdead).tolist(), "row_ids": _hash(fhs, cids, fdead).tolist()},
        ],
    }
    doc = {
        "generator": GENERATOR,
        "what": "Engram n-gram hash known answers computed by R-HF's DeepseekV41NgramHashState (spec §2.3.1); "
        "row_ids[t][L][j] = hash + offset for engram layer index L (order of engram_layer_ids), column "
        "j = (n-2)*engram_n_heads + head; 'dead' lists, per position, True where the position is DEAD "
        "(image span / padding); token_ids go through cmap first",
        "checked_against": "spec deepseek-v41.md App. A.1 (primes, multipliers, offsets, row totals) and App. A.2 "
        "(primes, multipliers, the six row-id rows and the DEAD row)",
        "reference": install_v41_reference.status(),
        **cases,
    }
    d = os.path.join(out_root, "v41_engram")
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, "engram_kat.json")
    with open(p, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return {"total_bytes": os.path.getsize(p)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="fixture names (default: all): " + ", ".join([*FIXTURES, "v41_engram"]))
    ap.add_argument("--out", default=OUT_DEFAULT)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    names = a.only or [*FIXTURES, "v41_engram"]

    def log(s):
        print(s, flush=True)

    st = install_v41_reference.status()
    if not install_v41_reference.ok(st):
        print("R-HF V4.1 not installed as pinned: run python/install_v41_reference.py", file=sys.stderr)
        return 2
    official.self_test()
    total = 0
    for n in names:
        if n == "v41_engram":
            total += make_engram_kat(a.out, log)["total_bytes"]
        elif n in FIXTURES:
            total += make_fixture(n, FIXTURES[n], a.out, log)["total_bytes"]
        else:
            ap.error(f"unknown fixture {n}")
    log(f"done: {total / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
