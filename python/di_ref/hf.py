"""Runs HF transformers' DeepseekV4ForCausalLM (the independent reference, R-HF) and captures what
the C engine is compared against.

* `reference()`: full forward (use_cache=False) -> logits, each decoder layer's output streams,
  each attention module's output, each CSA layer's indexer selection per query, and the MTP logits
  (spec §6.3 step 5, §6.4), plus statistics: SwiGLU clamp fractions, indexer top-k gaps, router
  top-k gaps (spec §6.3 step 8).
* `streaming_logits()`: the same sequence fed as prefill -> decode -> prefill chunks with the HF
  cache (spec §6.3 step 6).
* `greedy_generate()`: HF `generate`, greedy, EOS disabled; cross-checked against the full forward.
* `check_rope_tables()`: HF inv_freq tables vs spec §2.0 formulas and the §6.5 table.
* `shared_expert_clamp()`: whether this transformers' DeepseekV4MLP clamps (spec §2.8).
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import torch
import torch.nn.functional as F

from transformers import DynamicCache, GenerationConfig
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl

from . import model as spec_model
from .tiny import CSA, MTPBlock

# spec §6.3 step 8: reseed if any indexer top-k gap < 1e-4.
INDEXER_GAP_MIN = 1e-4
# Router top-k near-ties flip expert choice just like indexer ones; FP32 noise in the router
# scores of an engine is ~1e-6, so 1e-5 leaves a 10x margin.
ROUTER_GAP_MIN = 1e-5


def gaps_ok(st: dict) -> bool:
    """No indexer / router top-k decision of this run is a near-tie."""
    ig, rg = st["indexer_min_topk_gap"], st["router_min_topk_gap"]
    return (ig is None or ig >= INDEXER_GAP_MIN) and (rg is None or rg >= ROUTER_GAP_MIN)


# ---- full forward with captures ----


class _Stats:
    def __init__(self):
        self.clamp = {"routed": [0, 0, 0], "shared": [0, 0, 0]}  # [n_gate_clamped, n_up_clamped, n_values]
        self.router_gap = math.inf
        self.router_decisions = 0


def _clamp_hooks(module, stats: _Stats, limit: float, handles: list) -> None:
    for m in module.modules():
        if isinstance(m, mdl.DeepseekV4Experts):

            def pre(mod, args, kwargs=None):
                h, idx, _w = args[:3]
                Fi = mod.intermediate_dim
                gu = torch.einsum("nkfd,nd->nkf", mod.gate_up_proj[idx], h)  # [N, K, 2F]
                g, u = gu[..., :Fi], gu[..., Fi:]
                s = stats.clamp["routed"]
                s[0] += int((g > limit).sum())
                s[1] += int((u.abs() > limit).sum())
                s[2] += g.numel() + u.numel()

            handles.append(m.register_forward_pre_hook(pre))
        if isinstance(m, mdl.DeepseekV4MLP):

            def pre_s(mod, args):
                x = args[0]
                g, u = mod.gate_proj(x), mod.up_proj(x)
                s = stats.clamp["shared"]
                s[0] += int((g > limit).sum())
                s[1] += int((u.abs() > limit).sum())
                s[2] += g.numel() + u.numel()

            handles.append(m.register_forward_pre_hook(pre_s))
        if isinstance(m, mdl.DeepseekV4TopKRouter):

            def post_r(mod, args, out):
                logits = out[0]
                biased = mod.score_fn(logits) + mod.e_score_correction_bias
                srt = biased.sort(dim=-1, descending=True).values
                K = mod.top_k
                if srt.shape[-1] > K:
                    stats.router_gap = min(stats.router_gap, float((srt[:, K - 1] - srt[:, K]).min()))
                    stats.router_decisions += srt.shape[0]

            handles.append(m.register_forward_hook(post_r))


def reference(model, mtp: MTPBlock, ids: torch.Tensor) -> tuple[dict, dict]:
    """ids: int64 [T]. Returns (tensors, stats); tensors use the ref.safetensors names."""
    cfg = model.config
    L, T, topk = cfg.num_hidden_layers, ids.shape[0], cfg.index_topk
    m_csa = cfg.compress_rates[CSA]
    layer_out, attn_out, picks, scores = {}, {}, {}, {}
    stats = _Stats()
    handles = []
    for l, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_hook(lambda mod, a, out, l=l: layer_out.__setitem__(l, out[0].detach().clone())))
        handles.append(
            layer.self_attn.register_forward_hook(lambda mod, a, out, l=l: attn_out.__setitem__(l, out[0][0].detach().clone()))
        )
        if cfg.layer_types[l] == CSA:
            ix = layer.self_attn.compressor.indexer
            handles.append(ix.register_forward_hook(lambda mod, a, out, l=l: picks.__setitem__(l, out[0].detach().clone())))
            handles.append(ix.scorer.register_forward_hook(lambda mod, a, out, l=l: scores.__setitem__(l, out[0].detach().clone())))
    _clamp_hooks(model, stats, cfg.swiglu_limit, handles)
    _clamp_hooks(mtp, stats, cfg.swiglu_limit, handles)
    try:
        with torch.no_grad():
            logits = model(ids[None], use_cache=False).logits[0]
            x_last = layer_out[L - 1]  # [T, NC, D], before hc_head (spec §6.4)
            mtp_logits = mtp(model, x_last[None, :-1], ids[None, 1:])[0]
    finally:
        for h in handles:
            h.remove()

    out = {"input_ids": ids.to(torch.int32), "logits": logits.float(), "mtp_logits": mtp_logits.float()}
    for l in range(L):
        out[f"layer_out.{l}"] = layer_out[l].float()
        out[f"attn_out.{l}"] = attn_out[l].float()
        assert layer_out[l].shape == (T, cfg.hc_mult, cfg.hidden_size)
        assert attn_out[l].shape == (T, cfg.hidden_size)

    # Indexer: HF's picks (-1 = invalid) -> visible picks sorted ascending, padded with -1 to topk.
    # Cross-checked against an independent top-k over the scorer's scores; record the k-th gap.
    min_gap, n_active, n_queries = math.inf, 0, 0
    for l in sorted(picks):
        p, sc = picks[l], scores[l]
        tab = torch.full((T, topk), -1, dtype=torch.int32)
        for t in range(T):
            n_vis = (t + 1) // m_csa
            sel = sorted(v for v in p[t].tolist() if v >= 0)
            assert all(v < n_vis for v in sel), (l, t, sel, n_vis)
            assert len(sel) == min(topk, n_vis), (l, t, sel, n_vis)
            tab[t, : len(sel)] = torch.tensor(sel, dtype=torch.int32)
            n_queries += 1
            if n_vis > topk:
                n_active += 1
                s = sc[t, :n_vis]
                order = torch.sort(s, descending=True, stable=True)
                gap = float(order.values[topk - 1] - order.values[topk])
                min_gap = min(min_gap, gap)
                if gap > 0:  # with an exact tie HF's pick among the tied entries is arbitrary
                    mine = sorted(order.indices[:topk].tolist())
                    assert mine == sel, (l, t, mine, sel)
        out[f"indexer_topk.{l}"] = tab

    def frac(c):
        return (c[0] + c[1]) / c[2] if c[2] else 0.0

    r, s = stats.clamp["routed"], stats.clamp["shared"]
    tot = [r[i] + s[i] for i in range(3)]
    st = {
        "clamp_fraction": frac(tot),
        "clamp_fraction_routed": frac(r),
        "clamp_fraction_shared": frac(s),
        "clamp_fraction_gate": tot[0] / (tot[2] / 2) if tot[2] else 0.0,
        "clamp_fraction_up": tot[1] / (tot[2] / 2) if tot[2] else 0.0,
        "indexer_min_topk_gap": None if math.isinf(min_gap) else min_gap,
        "indexer_queries_topk_active": n_active,
        "indexer_queries_total": n_queries,
        "router_min_topk_gap": None if math.isinf(stats.router_gap) else stats.router_gap,
        "router_decisions": stats.router_decisions,
        "logits_abs_max": float(logits.abs().max()),
        "logits_std": float(logits.std()),
        "mtp_logits_abs_max": float(mtp_logits.abs().max()),
        "mtp_logits_std": float(mtp_logits.std()),
        "layer_out_abs_max": [float(layer_out[l].abs().max()) for l in range(L)],
        "attn_out_abs_max": [float(attn_out[l].abs().max()) for l in range(L)],
    }
    return out, st


# ---- streaming (prefill -> decode -> prefill) ----


def stream_schedule(T: int) -> list[int]:
    """spec §6.3 step 6: 21-token prefill, 6 single steps, a 13-token chunk, single tokens to 64;
    beyond 64 alternately a 37-token chunk and 5 single steps. Clipped to T."""
    pat = [21] + [1] * 6 + [13] + [1] * (64 - 40)
    while sum(pat) < T:
        pat += [37] + [1] * 5
    out, n = [], 0
    for c in pat:
        if n >= T:
            break
        c = min(c, T - n)
        out.append(c)
        n += c
    return out


def streaming_logits(model, ids: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    cache = DynamicCache(config=model.config)
    outs, pos = [], 0
    with torch.no_grad():
        for n in schedule:
            chunk = ids[pos : pos + n][None]
            position_ids = torch.arange(pos, pos + n)[None]
            o = model(chunk, cache=cache, use_cache=True, position_ids=position_ids)
            outs.append(o.logits[0])
            pos += n
    # The HF cache layers are the CSA/HCA ones (spec §3.1).
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert pos == ids.shape[0]
    return torch.cat(outs, 0), sorted(kinds)


# ---- greedy generation ----


def greedy_generate(model, prompt: torch.Tensor, n_new: int) -> tuple[torch.Tensor, float | None]:
    """HF greedy generate (do_sample=False, the model's EOS kept). Returns (new tokens, min top1-top2
    margin of the teacher-forced full forward over the generated positions). Generation that stops
    early (EOS) returns fewer tokens and margin None: callers reject such prompts, so the fixture
    holds whether or not an engine stops at EOS."""
    gc = GenerationConfig(
        do_sample=False, max_new_tokens=n_new, eos_token_id=model.config.eos_token_id, pad_token_id=0, bos_token_id=0
    )
    with torch.no_grad():
        out = model.generate(prompt[None], generation_config=gc)
    new = out[0, prompt.shape[0] :]
    if new.shape[0] != n_new or int(model.config.eos_token_id) in new.tolist():
        return new, None
    # Cross-check with the cache-free full forward (teacher forcing).
    full = torch.cat([prompt, new])
    with torch.no_grad():
        lg = model(full[None, :-1], use_cache=False).logits[0, prompt.shape[0] - 1 :]
    top2 = lg.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    assert torch.equal(lg.argmax(-1), new), "generate() disagrees with the full forward"
    return new, margin


# ---- facts about the installed HF ----


# spec §6.5 (main, compress) for i in the keys.
SPEC_ROPE_TABLE = {
    0: (1.0, 1.0),
    1: (0.749894202, 0.687656045),
    15: (0.0133352149, 0.00363553851),
    16: (0.00999999978, 0.00226562495),
    20: (0.00316227786, 0.000296977783),
    24: (0.00100000005, 1.95312509e-05),
    25: (0.000749894185, 5.37231244e-06),
    31: (0.00013335215, 5.6805294e-07),
}


def check_rope_tables(model) -> dict:
    """spec §6.3 step 3. Raises if the HF tables differ from §2.0 (rel > 1e-6) or §6.5 (rel > 1e-7)."""
    cfg = model.config
    re_ = model.model.rotary_emb
    main = re_.main_inv_freq.float().numpy()
    comp = re_.compress_inv_freq.float().numpy()
    assert re_.main_attention_scaling == 1.0 and re_.compress_attention_scaling == 1.0
    dim = cfg.qk_rope_head_dim
    rp = cfg.rope_parameters["compress"]
    ref_main, ref_comp = (t.numpy() for t in spec_model.rope_tables({"qk_rope_head_dim": dim, "rope_parameters": cfg.rope_parameters}))
    low, high = spec_model.yarn_range(dim, rp["rope_theta"], rp["original_max_position_embeddings"], rp["beta_fast"], rp["beta_slow"])
    rel_main = float(np.max(np.abs(main - ref_main) / ref_main))
    rel_comp = float(np.max(np.abs(comp - ref_comp) / ref_comp))
    spec_rel = 0.0
    if dim == 64 and rp["rope_theta"] == 160000.0:
        for i, (a, b) in SPEC_ROPE_TABLE.items():
            spec_rel = max(spec_rel, abs(main[i] - a) / a, abs(comp[i] - b) / b)
        assert spec_rel < 1e-7, spec_rel
        assert (low, high) == (15, 25), (low, high)
    assert rel_main < 1e-6 and rel_comp < 1e-6, (rel_main, rel_comp)
    # Every compressor / indexer owns a rotary_emb: all must carry the same tables.
    for m in model.modules():
        if isinstance(m, mdl.DeepseekV4RotaryEmbedding):
            assert torch.equal(m.main_inv_freq, re_.main_inv_freq)
            assert torch.equal(m.compress_inv_freq, re_.compress_inv_freq)
    return {
        "main_inv_freq": [float(x) for x in main],
        "compress_inv_freq": [float(x) for x in comp],
        "yarn_low_high": [low, high],
        "max_rel_diff_vs_spec_2_0_formula": {"main": rel_main, "compress": rel_comp},
        "max_rel_diff_vs_spec_6_5_table": float(spec_rel),
    }


def shared_expert_clamp() -> dict:
    """Does DeepseekV4MLP.forward apply the SwiGLU clamp (spec §2.8)? Tested empirically."""
    from .tiny import make_config

    cfg = make_config("tiny", swiglu_limit=0.05)
    torch.manual_seed(0)
    mlp = mdl.DeepseekV4MLP(cfg).float()
    x = torch.randn(16, cfg.hidden_size) * 3
    with torch.no_grad():
        y = mlp(x)
        plain = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        g = mlp.gate_proj(x).clamp(max=0.05)
        u = mlp.up_proj(x).clamp(-0.05, 0.05)
        clamped = mlp.down_proj(F.silu(g) * u)
    is_clamped = bool(torch.allclose(y, clamped, atol=1e-6) and not torch.allclose(y, plain, atol=1e-3))
    is_plain = bool(torch.allclose(y, plain, atol=1e-6))
    assert is_clamped != is_plain
    src = inspect.getsource(mdl.DeepseekV4MLP.forward)
    return {
        "shared_expert_clamped": is_clamped,
        "rule": "gate = min(gate, L); up = clamp(up, -L, L)" if is_clamped else "no clamp",
        "source_mentions_clamp": "clamp" in src,
    }
