"""DeepSeek-V4.1 reference side (R-HF = upstream transformers `deepseek_v41`, installed by
python/install_v41_reference.py; spec deepseek-v41.md §7.4):

* config presets (`PRESETS`), `build()`: FP32 CPU eager model, Engram stub map injected, constants
  randomised, every float parameter bf16-representable and every FP8/FP4-stored weight already on its
  quantisation grid (32x32 UE8M0 FP8, 1x32 UE8M0 FP4 experts, 1x32 UE8M0 FP8 Engram rows), so hf/ and
  official/ hold exactly the same values;
* native (checkpoint) names of §6.4 ↔ R-HF runtime names, the official layout (§6.2) and its
  dequantisation;
* `run()`: one forward with hooks capturing every block's output streams, attention outputs, the
  per-forward shared state (Cmain, Kidx, top-k, candidate mask), Engram hash ids and the indexer /
  candidate / router decision gaps;
* `stream()`: the same sequence through `DynamicCache` in chunks (chunked prefill, token-by-token).
"""

from __future__ import annotations

import json
import os

import torch

from . import dump, official

# Importing the modeling file prints auto-docstring "[ERROR] Config not found" lines: harmless.
from transformers import DynamicCache  # noqa: E402
from transformers.models.deepseek_v41 import modeling_deepseek_v41 as mdl  # noqa: E402
from transformers.models.deepseek_v41.configuration_deepseek_v41 import (  # noqa: E402
    DeepseekV41Config,
    DeepseekV41TextConfig,
)

DeepseekV41ForCausalLM = mdl.DeepseekV41ForCausalLM

# ---- configs ----

# Spec §7.4 exactly (R-HF keyword arguments); initializer_range is the one free choice.
TINY = dict(
    vocab_size=512, hidden_size=256, num_hidden_layers=6, num_nextn_predict_layers=0,
    compress_ratios=[0, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 5],
    candidate_source_layer_id=3, candidate_topk_blocks=3, candidate_block_size=4,
    index_n_heads=4, index_head_dim=64, index_topk=8,
    num_attention_heads=4, num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64,
    o_groups=2, o_lora_rank=64, sliding_window=16,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5, gate_temp=1.0, swiglu_limit=10.0,
    rms_norm_eps=1e-20, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.25, "factor": 4.0,
                     "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                     "attention_factor": 1.0},
    },
    max_position_embeddings=4096,
    engram_layer_ids=[0, 1], engram_num_embeddings=[660, 864], engram_vocab_size=100, engram_max_ngram_size=4,
    engram_n_heads=2, engram_head_dim=32, engram_pad_id=2, engram_compressed_vocab_size=256,
    tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0, initializer_range=0.0625,
)

# Longer sequences: many compressed groups, both top-k levels really active. 7 layers: SWA, m=2 source
# (+Engram), m=2 reuse, m=2 reindex (index source without own keys), m=1 source = candidate source
# (+Engram), m=1 reuse, m=1 reindex inside the candidate pool. Small index_head_dim (32) and few layers keep
# the number of fake-quantised values (and so of rounding-boundary rejects) down.
LONG = dict(
    TINY,
    vocab_size=256, hidden_size=128, num_hidden_layers=7,
    compress_ratios=[0, 2, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 4], index_source_layer_ids=[1, 3, 4, 6],
    candidate_source_layer_id=4, candidate_topk_blocks=4, candidate_block_size=8,
    index_n_heads=4, index_head_dim=32, index_topk=16,
    num_attention_heads=2, o_groups=1, o_lora_rank=64, q_lora_rank=64,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    engram_layer_ids=[1, 4], engram_num_embeddings=[660, 864], engram_compressed_vocab_size=128,
    initializer_range=0.08,
)

# Unseen-config presets for check_unseen.py --arch v41 (never used for fixtures).
UNSEEN = dict(
    TINY,
    vocab_size=384, hidden_size=192, num_hidden_layers=5,
    compress_ratios=[2, 0, 2, 1, 1], kv_source_layer_ids=[0, 3], index_source_layer_ids=[0, 3, 4],
    candidate_source_layer_id=3, candidate_topk_blocks=2, candidate_block_size=8,
    index_n_heads=8, index_topk=12, sliding_window=8,
    num_attention_heads=3, o_groups=3, o_lora_rank=32, num_experts_per_tok=3, n_routed_experts=6,
    routed_scaling_factor=2.5, gate_temp=1.3, swiglu_limit=0.5,
    engram_layer_ids=[0, 2], engram_num_embeddings=[660, 864], engram_compressed_vocab_size=192,
)

PRESETS = {"tiny": TINY, "long": LONG, "unseen": UNSEEN}

EXPECT_LAYER_TYPES = {
    "tiny": ["sliding_attention", "shared_compressed_attention", "sliding_attention",
             "shared_compressed_attention", "sliding_attention", "sliding_attention"],
}


def make_config(preset: str, **override) -> DeepseekV41TextConfig:
    kw = dict(PRESETS[preset])
    kw.update(override)
    cfg = DeepseekV41TextConfig(**kw)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    if preset in EXPECT_LAYER_TYPES:
        assert cfg.layer_types == EXPECT_LAYER_TYPES[preset], cfg.layer_types
    assert cfg.compress_ratios == kw["compress_ratios"], cfg.compress_ratios
    assert cfg.rope_parameters["compress"]["attention_factor"] == 1.0
    # The stub map id div 2 has vocab_size / 2 distinct ids; R-OFF asserts that this equals
    # engram_compressed_vocab_size (the hash multipliers derive from it), R-HF does not check.
    assert cfg.engram_compressed_vocab_size == (cfg.vocab_size + 1) // 2, cfg.engram_compressed_vocab_size
    return cfg


def cmap(cfg) -> torch.Tensor:
    """The Engram stub compressed-token map of spec §7.4: cmap[id] = id div 2."""
    return torch.arange(cfg.vocab_size, dtype=torch.long) // 2


def bind_stub_(model) -> None:
    hs = model.model.engram_hash_state
    if hs is None:
        return
    m = cmap(model.config)
    assert int(m.max()) < model.config.engram_compressed_vocab_size
    hs.token_map = m
    hs.pad_id = int(m[model.config.engram_pad_id])


# ---- quantisation grids (official layout, spec §6.2) ----

FP8_BLOCK = 32


def quant_fp8_rows(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> e4m3 codes [R, C], UE8M0 scale bytes [R, C/block] (one scale per 1 x block)."""
    R, C = w.shape
    assert C % block == 0
    b = w.float().view(R, C // block, block)
    amax = b.abs().amax(-1).clamp(min=1e-4)
    e = official.ceil_log2_f32(amax * torch.tensor(1.0 / 448.0, dtype=torch.float32))
    s = torch.pow(2.0, e.float())
    codes = official.e4m3_encode(b / s[..., None]).view(R, C)
    return codes, official.ue8m0_encode(e)


def dequant_fp8_rows(codes: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    return official.e4m3_decode(codes) * official.ue8m0_decode(scale).repeat_interleave(block, 1)


def fp8_grid(w: torch.Tensor) -> torch.Tensor:
    c, s = official.quant_fp8_block(w, FP8_BLOCK)
    return official.dequant_fp8_block(c, s, FP8_BLOCK)


def fp4_grid(w: torch.Tensor) -> torch.Tensor:
    p, s = official.quant_fp4_rows(w)
    return official.dequant_fp4_rows(p, s)


def fp8_rows_grid(w: torch.Tensor) -> torch.Tensor:
    c, s = quant_fp8_rows(w)
    return dequant_fp8_rows(c, s)


# ---- build ----


def randomise_constants_(model, g: torch.Generator) -> None:
    """Spec §7.4: randomise what R-HF initialises to constants (engram_tables.*.weight_scale_inv stays 1)."""
    def n(shape, std):
        return torch.randn(shape, generator=g) * std

    for name, mod in model.named_modules():
        if isinstance(mod, mdl.DeepseekV41Attention):
            mod.sinks.copy_(n(mod.sinks.shape, 1.0))
        elif isinstance(mod, mdl.DeepseekV41HyperConnection):
            mod.base.copy_(n(mod.base.shape, 0.5))
            mod.scale.copy_(1.0 + n(mod.scale.shape, 0.2))
        elif isinstance(mod, mdl.DeepseekV41RMSNorm):
            mod.weight.copy_(1.0 + n(mod.weight.shape, 0.1))
        elif isinstance(mod, mdl.DeepseekV41TopKRouter):
            mod.e_score_correction_bias.copy_(n(mod.e_score_correction_bias.shape, 0.1))
            mod.e_score_correction_bias_vl.copy_(n(mod.e_score_correction_bias_vl.shape, 0.1))
        elif isinstance(mod, mdl.DeepseekV41Engram):
            mod.q_weight.copy_(1.0 + n(mod.q_weight.shape, 0.3))
            mod.k_weight.copy_(1.0 + n(mod.k_weight.shape, 0.3))
        elif isinstance(mod, mdl.DeepseekV41Indexer):
            # Tie avoidance (a free choice of the random weights; the ReLU makes exact zero scores,
            # i.e. ties at the top-k boundary, common otherwise): nearly equal weights_proj rows give
            # every query head weights of one sign.
            # Keys of one source share a common direction, so with independent query heads whole
            # ranges of entries get q.k <= 0 on every head and score exactly 0. Pairing heads as
            # antipodes (head 2i+1 = -head 2i; exact on the FP8/FP4 grids and through RoPE) leaves
            # one positive ReLU term per pair for every entry.
            w = mod.weights_proj.weight
            w.copy_(8.0 * (w[:1].expand_as(w) + 0.1 * w))  # x8: larger score gaps
            q = mod.q_b_proj.weight.view(mod.num_heads, mod.head_dim, -1)
            q[1::2] = -q[0::2]


def to_grids_(model) -> None:
    """bf16-round every float tensor, then put the FP8 / FP4 stored weights on their grids (the grids
    are bf16-exact), so the native BF16 file and the official FP8/FP4 file hold the same values."""
    # Parameters and persistent buffers only (state_dict): the rope inv_freq tables stay as computed.
    for _, p in model.state_dict().items():
        if p.is_floating_point() and p.dtype == torch.float32:
            p.copy_(p.bfloat16().float())
    for name, mod in model.named_modules():
        if isinstance(mod, mdl.DeepseekV41Attention):
            for lin in (mod.q_a_proj, mod.q_b_proj, mod.kv_proj, mod.o_a_proj, mod.o_b_proj):
                lin.weight.copy_(fp8_grid(lin.weight))
            if mod.indexer is not None:
                mod.indexer.q_b_proj.weight.copy_(fp8_grid(mod.indexer.q_b_proj.weight))
        elif isinstance(mod, mdl.DeepseekV41MLP):
            for lin in (mod.gate_proj, mod.up_proj, mod.down_proj):
                lin.weight.copy_(fp8_grid(lin.weight))
        elif isinstance(mod, mdl.DeepseekV41Experts):
            for e in range(mod.num_experts):
                mod.gate_up_proj[e].copy_(fp4_grid(mod.gate_up_proj[e]))
                mod.down_proj[e].copy_(fp4_grid(mod.down_proj[e]))
        elif isinstance(mod, mdl.DeepseekV41Engram):
            mod.wkv.weight.copy_(fp8_grid(mod.wkv.weight))
        elif isinstance(mod, mdl.DeepseekV41EngramEmbedding):
            mod.weight.copy_(fp8_rows_grid(mod.weight))
    for _, p in model.named_parameters():
        assert torch.equal(p.bfloat16().float(), p), "grid value not bf16-exact"


def build(cfg, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        model = DeepseekV41ForCausalLM(cfg).eval()
        assert model.config.model_type == "deepseek_v41_text"
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
        randomise_constants_(model, torch.Generator().manual_seed(seed * 7919 + 1))
        to_grids_(model)
    bind_stub_(model)
    for t in model.model.engram_tables.values():
        assert bool((t.weight_scale_inv == 1).all())
    return model


def random_ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g)


# ---- names (spec §6.4) ----

_LAYER_MAP = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
    ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.indexer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("self_attn.indexer.k_proj.weight", "attn.indexer.wk.weight"),
    ("self_attn.indexer.k_norm.weight", "attn.indexer.k_norm.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.e_score_correction_bias_vl", "ffn.gate.bias_vl"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
    ("engram.wkv.weight", "engram.wkv.weight"),
    ("engram.q_weight", "engram.q_weight"),
    ("engram.k_weight", "engram.k_weight"),
]
_TOP_MAP = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
            "model.norm.weight": "norm.weight"}

# Storage kinds of the native names (spec §6.2): FP8 32x32 linears, FP4 experts, F32, else BF16.
FP8_SUFFIXES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
                "attn.indexer.wq_b.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
                "ffn.shared_experts.w3.weight", "engram.wkv.weight")
F32_SUFFIXES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                "attn.attn_sink", "ffn.gate.bias", "ffn.gate.bias_vl")


def native_state_dict(model) -> dict:
    """R-HF runtime state dict -> native checkpoint names (FP32 values); experts split per expert,
    engram `weight_scale_inv` dropped. Every runtime key must be accounted for."""
    sd = model.state_dict()
    out, used = {}, set()
    for k, v in _TOP_MAP.items():
        out[v] = sd[k]
        used.add(k)
    for k, t in sd.items():
        if k.startswith("model.engram_tables."):
            i = k.split(".")[2]
            if k.endswith(".weight_scale_inv"):
                used.add(k)
                continue
            out[f"layers.{i}.engram.embed.weight"] = t
            used.add(k)
    for i in range(model.config.num_hidden_layers):
        pre = f"model.layers.{i}."
        for a, b in _LAYER_MAP:
            if pre + a in sd:
                out[f"layers.{i}.{b}"] = sd[pre + a]
                used.add(pre + a)
        gu, dn = sd[pre + "mlp.experts.gate_up_proj"], sd[pre + "mlp.experts.down_proj"]
        F = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            out[f"layers.{i}.ffn.experts.{e}.w1.weight"] = gu[e, :F]
            out[f"layers.{i}.ffn.experts.{e}.w3.weight"] = gu[e, F:]
            out[f"layers.{i}.ffn.experts.{e}.w2.weight"] = dn[e]
        used.update({pre + "mlp.experts.gate_up_proj", pre + "mlp.experts.down_proj"})
    left = sorted(set(sd) - used)
    assert not left, left
    return {k: v.detach().float().clone() for k, v in out.items()}


def load_native_(model, native: dict) -> None:
    """Inverse of native_state_dict (used to reload hf/ and official/ and compare)."""
    sd = {}
    for k, v in _TOP_MAP.items():
        sd[k] = native[v]
    for i in range(model.config.num_hidden_layers):
        pre = f"model.layers.{i}."
        for a, b in _LAYER_MAP:
            if f"layers.{i}.{b}" in native:
                sd[pre + a] = native[f"layers.{i}.{b}"]
        E = model.config.n_routed_experts
        ex = f"layers.{i}.ffn.experts."
        sd[pre + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([native[f"{ex}{e}.w1.weight"], native[f"{ex}{e}.w3.weight"]]) for e in range(E)])
        sd[pre + "mlp.experts.down_proj"] = torch.stack([native[f"{ex}{e}.w2.weight"] for e in range(E)])
        if f"layers.{i}.engram.embed.weight" in native:
            sd[f"model.engram_tables.{i}.weight"] = native[f"layers.{i}.engram.embed.weight"]
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    assert not unexpected, unexpected
    assert all(m.endswith("weight_scale_inv") for m in missing), missing


def _suffix(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("layers.") else name


def native_stored(native: dict) -> dict:
    """hf/model.safetensors: release float dtypes (F32 for hc/sink/gate bias, BF16 otherwise; values
    are bf16-exact), no scales."""
    out = {}
    for k, t in native.items():
        if _suffix(k) in F32_SUFFIXES:
            out[k] = ("F32", t.float())
        else:
            bf = t.to(torch.bfloat16)
            assert torch.equal(bf.float(), t), k
            out[k] = ("BF16", bf)
    return out


def official_stored(native: dict) -> dict:
    """official/model.safetensors (spec §6.2): FP8 e4m3 + 32x32 UE8M0 `.scale`; experts packed e2m1
    I8 [out, in/2] + 1x32 UE8M0 `.scale`; Engram tables e4m3 + per-row 1x32 UE8M0 `.scale`."""
    out = {}
    for k, t in native.items():
        s = _suffix(k)
        base = k[: -len(".weight")]
        if s in FP8_SUFFIXES:
            c, sc = official.quant_fp8_block(t, FP8_BLOCK)
            out[k], out[base + ".scale"] = ("F8_E4M3", c), ("F8_E8M0", sc)
        elif s.startswith("ffn.experts."):
            p, sc = official.quant_fp4_rows(t)
            out[k], out[base + ".scale"] = ("I8", p), ("F8_E8M0", sc)
        elif s == "engram.embed.weight":
            c, sc = quant_fp8_rows(t)
            out[k], out[base + ".scale"] = ("F8_E4M3", c), ("F8_E8M0", sc)
        elif s in F32_SUFFIXES:
            out[k] = ("F32", t.float())
        else:
            bf = t.to(torch.bfloat16)
            assert torch.equal(bf.float(), t), k
            out[k] = ("BF16", bf)
    return out


def dequant_official(stored: dict) -> dict:
    out = {}
    for k, (dt, t) in stored.items():
        if k.endswith(".scale"):
            continue
        sc = stored.get(k[: -len(".weight")] + ".scale", (None, None))[1]
        if dt == "F8_E4M3" and _suffix(k) == "engram.embed.weight":
            out[k] = dequant_fp8_rows(t, sc)
        elif dt == "F8_E4M3":
            out[k] = official.dequant_fp8_block(t, sc, FP8_BLOCK)
        elif dt == "I8":
            out[k] = official.dequant_fp4_rows(t, sc)
        else:
            out[k] = t.float()
    return out


def hf_config_json(cfg) -> dict:
    """hf/config.json in the release's composite form (model_type deepseek_v41, text_config)."""
    d = DeepseekV41Config(text_config=cfg.to_dict()).to_dict()
    d["architectures"] = ["DeepseekV41ForCausalLM"]
    d.pop("transformers_version", None)
    d["text_config"].pop("transformers_version", None)
    return d


def official_config_json(cfg) -> dict:
    """official/config.json: flat ModelArgs names (spec §1.1; field set of the released
    inference/config.json, plus gate_temp which the release leaves at its ModelArgs default)."""
    c = cfg
    rp = c.rope_parameters["compress"]
    return {
        "vocab_size": c.vocab_size, "dim": c.hidden_size, "moe_inter_dim": c.moe_intermediate_size,
        "n_layers": c.num_hidden_layers, "n_mtp_layers": c.num_nextn_predict_layers,
        "n_heads": c.num_attention_heads, "n_routed_experts": c.n_routed_experts,
        "n_shared_experts": c.n_shared_experts, "n_activated_experts": c.num_experts_per_tok,
        "score_func": c.scoring_func, "route_scale": c.routed_scaling_factor, "gate_temp": c.gate_temp,
        "swiglu_limit": c.swiglu_limit, "q_lora_rank": c.q_lora_rank, "head_dim": c.head_dim,
        "rope_head_dim": int(c.head_dim * rp["partial_rotary_factor"]), "norm_eps": c.rms_norm_eps,
        "o_groups": c.o_groups, "o_lora_rank": c.o_lora_rank, "window_size": c.sliding_window,
        "kv_source_layers": list(c.kv_source_layer_ids), "index_source_layers": list(c.index_source_layer_ids),
        "original_seq_len": rp["original_max_position_embeddings"],
        "rope_theta": c.rope_parameters["main"]["rope_theta"],
        "rope_factor": rp["factor"], "beta_fast": rp["beta_fast"], "beta_slow": rp["beta_slow"],
        "index_n_heads": c.index_n_heads, "index_head_dim": c.index_head_dim, "index_topk": c.index_topk,
        "candidate_source_layer": c.candidate_source_layer_id, "candidate_topk_blocks": c.candidate_topk_blocks,
        "candidate_block_size": c.candidate_block_size, "hc_mult": c.hc_mult,
        "hc_sinkhorn_iters": c.hc_sinkhorn_iters, "hc_eps": c.hc_eps,
        "engram_layer_ids": list(c.engram_layer_ids), "engram_vocab_size": c.engram_vocab_size,
        "engram_num_embeddings": list(c.engram_num_embeddings), "engram_max_ngram_size": c.engram_max_ngram_size,
        "engram_pad_id": c.engram_pad_id, "engram_compressed_vocab_size": c.engram_compressed_vocab_size,
        "engram_n_heads": c.engram_n_heads, "engram_head_dim": c.engram_head_dim,
        "dtype": "fp8", "expert_dtype": "fp4", "compress_rope_theta": rp["rope_theta"],
        "compress_ratios": list(c.compress_ratios),
    }


def write_hf(directory: str, cfg, native: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    dump.write_json(os.path.join(directory, "config.json"), hf_config_json(cfg))
    dump.write_safetensors(os.path.join(directory, "model.safetensors"), native_stored(native),
                           metadata={"format": "pt"})


def write_official(directory: str, cfg, native: dict) -> dict:
    os.makedirs(directory, exist_ok=True)
    dump.write_json(os.path.join(directory, "config.json"), official_config_json(cfg))
    stored = official_stored(native)
    dump.write_safetensors(os.path.join(directory, "model.safetensors"), stored, metadata={"format": "pt"})
    return stored


def write_token_map(directory: str, cfg) -> None:
    """engram/token_map.safetensors: the compressed-token map the C engine reads beside a V4.1
    checkpoint (tensor "token_map", I32 [vocab]); here the stub map of cmap()."""
    if not cfg.engram_layer_ids:
        return
    os.makedirs(os.path.join(directory, "engram"), exist_ok=True)
    dump.write_safetensors(os.path.join(directory, "engram", "token_map.safetensors"),
                           {"token_map": cmap(cfg).to(torch.int32)}, metadata={"format": "pt"})


def load_dir(directory: str):
    """Rebuild an R-HF model from a written hf/ directory (composite config + native names)."""
    with open(os.path.join(directory, "config.json")) as f:
        d = json.load(f)
    cfg = DeepseekV41Config(**{k: v for k, v in d.items() if k != "architectures"}).text_config
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    with torch.no_grad():
        model = DeepseekV41ForCausalLM(cfg).eval()
    stored, _ = dump.read_safetensors(os.path.join(directory, "model.safetensors"))
    load_native_(model, {k: t.float() for k, (dt, t) in stored.items()})
    bind_stub_(model)
    return model


# ---- decision gaps (near-tie detection) ----


def _gap_at(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: s[k-1] - s[k] of the finite scores sorted descending (inf where <= k finite)."""
    s = scores.sort(dim=-1, descending=True).values
    n_fin = torch.isfinite(s).sum(-1)
    if s.shape[-1] <= k:
        return torch.full(s.shape[:-1], float("inf"))
    g = s[..., k - 1] - s[..., k]
    return torch.where(n_fin > k, g, torch.full_like(g, float("inf")))


def indexer_scores(ix, hidden_states, q_residual, position_ids, shared):
    """The indexer's masked FP32 scores (copy of the scoring arithmetic of DeepseekV41Indexer.forward),
    plus, for the candidate source, its block scores with the newest block pinned."""
    index_k = shared.get("index_k")
    if index_k is None or index_k.shape[2] == 0:
        return None, None
    B, S, _ = hidden_states.shape
    cos_q, sin_q = ix.rotary_emb(hidden_states, position_ids=position_ids, layer_type="compress")
    q = ix.q_b_proj(q_residual).view(B, S, ix.num_heads, ix.head_dim)
    q = mdl._fake_quant_fp4_block(mdl.apply_rotary_pos_emb(q, cos_q, sin_q), block_size=32).float()
    keys = index_k[:, 0].float()
    w = ix.weights_proj(hidden_states).float() * ix.heads_scaling
    sc = torch.einsum("bshd,btd->bsht", q, keys).relu() * ix.softmax_scale
    sc = (sc * w.unsqueeze(-1)).sum(2)
    lens = shared["compress_lens"].unsqueeze(-1)
    sc = sc.masked_fill(torch.arange(sc.shape[-1]).view(1, 1, -1) >= lens, float("-inf"))
    blocks = None
    if ix.is_candidate_source:
        bs = ix.candidate_block_size
        width = sc.shape[-1]
        b = torch.nn.functional.pad(sc, (0, -width % bs), value=float("-inf")).unflatten(-1, (-1, bs)).amax(-1)
        last = (lens - 1) // bs
        blocks = b.masked_fill(torch.arange(b.shape[-1]).view(-1) == last, float("-inf"))  # pinned: not a decision
    elif ix.uses_candidates and shared.get("candidates") is not None:
        sc = sc.masked_fill(~shared["candidates"], float("-inf"))
    return sc, blocks


# ---- quantisation-boundary margins ----

# The KV fake-quant (Q8w window rows, Q4e compressed entries, Q4 indexer q/k) turns a 1-ulp FP32
# difference (another GEMM blocking, another chunking) into a whole grid step when a value sits on a
# rounding boundary. A fixture input is accepted only if no quantised value (and no block scale) changes
# under a relative perturbation of QUANT_REL (+ QUANT_ABS of the block maximum).
QUANT_REL = 1e-6
QUANT_ABS = 1e-7
# Flips smaller than this fraction of the block maximum are ignored (0 = count every flip). Only FP8
# codes can flip by so little (near-zero e4m3 steps); an e2m1 step is >= 1/12 of the block maximum.
QUANT_SIGNIFICANT = 0.0


def _fragile_fp8(x: torch.Tensor, block: int) -> int:
    n = x.shape[-1]
    if n % block:
        return 0
    b = x.float().reshape(-1, n // block, block)
    amax = b.abs().amax(-1).clamp_min(1e-4)
    s = mdl._pow2_ceil_scale(amax * (1.0 / 448.0))
    bad = int((mdl._pow2_ceil_scale(amax * (1 + QUANT_REL) * (1.0 / 448.0)) != s).sum())
    q = (b / s.unsqueeze(-1)).clamp(-448.0, 448.0)
    e = QUANT_REL * q.abs() + QUANT_ABS * (amax / s).unsqueeze(-1)
    lo = (q - e).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    hi = (q + e).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    flip = (lo != hi) & ((hi - lo) >= QUANT_SIGNIFICANT * (amax / s).unsqueeze(-1))
    return bad + int(flip.sum())


def _fragile_fp4(x: torch.Tensor, block: int, e4m3_scales: bool = False) -> int:
    n = x.shape[-1]
    if n % block:
        return 0
    b = x.float().reshape(-1, n // block, block)
    amax = b.abs().amax(-1)
    if e4m3_scales:
        a = amax.clamp_min(6.0 * 2.0**-9) / 6.0
        s = a.to(torch.float8_e4m3fn).float()
        bad = int(((a * (1 - QUANT_REL)).to(torch.float8_e4m3fn).float()
                   != (a * (1 + QUANT_REL)).to(torch.float8_e4m3fn).float()).sum())
    else:
        a = amax.clamp_min(6.0 * 2.0**-126) * (1.0 / 6.0)
        s = mdl._pow2_ceil_scale(a)
        bad = int((mdl._pow2_ceil_scale(a * (1 + QUANT_REL)) != s).sum())
    q = (b / s.unsqueeze(-1)).clamp(-6.0, 6.0)
    e = QUANT_REL * q.abs() + QUANT_ABS * (amax / s).unsqueeze(-1)
    lo = mdl._e2m1_codes((q - e).clamp(-6.0, 6.0))
    hi = mdl._e2m1_codes((q + e).clamp(-6.0, 6.0))
    # -0 and +0 are the same value
    same = (lo == hi) | (((lo & 7) == 0) & ((hi & 7) == 0))
    return bad + int((~same).sum())


class QuantMargins:
    """Context manager: wraps the modeling file's fake-quant helpers and counts fragile values."""

    def __enter__(self):
        self.count = {"fp8_window": 0, "fp4_compressed": 0, "fp4_indexer": 0}
        self._f8, self._f4 = mdl._fake_quant_fp8_block, mdl._fake_quant_fp4_block

        def f8(x, block_size=32):
            self.count["fp8_window"] += _fragile_fp8(x, block_size)
            return self._f8(x, block_size)

        def f4(x, block_size, e4m3_scales=False):
            self.count["fp4_compressed" if e4m3_scales else "fp4_indexer"] += _fragile_fp4(x, block_size, e4m3_scales)
            return self._f4(x, block_size, e4m3_scales)

        mdl._fake_quant_fp8_block, mdl._fake_quant_fp4_block = f8, f4
        return self

    def __exit__(self, *exc):
        mdl._fake_quant_fp8_block, mdl._fake_quant_fp4_block = self._f8, self._f4
        return False


# ---- the reference run ----


def _sorted_picks(idx: torch.Tensor, k: int) -> torch.Tensor:
    """[S, k'] picks (-1 = none) -> ascending valid picks, -1 padded to k columns."""
    big = idx.masked_fill(idx < 0, 1 << 30).sort(-1).values
    big = big.masked_fill(big == (1 << 30), -1)
    if big.shape[-1] < k:
        big = torch.cat([big, big.new_full((big.shape[0], k - big.shape[-1]), -1)], -1)
    return big


def run(model, ids: torch.Tensor, cache=None, position_ids=None, gaps: bool = True) -> dict:
    """One forward of `ids` [S] with hooks. Without a cache (one-shot) the captured shared state is
    complete; with a cache the top-k picks and logits of this call are returned."""
    cfg = model.config
    cap = {"layer_out": {}, "hc_pre": {}, "attn_out": {}, "cmain": {}, "kidx": {}, "topk": {}, "cand": {},
           "idx_gap": {}, "cand_gap": {}, "router_gap": [], "hash": None}
    hooks = []
    for l, layer in enumerate(model.model.layers):
        def lay(mod, args, kwargs, out, l=l):
            cap["layer_out"][l] = out[0][0].detach().clone()
            cap["hc_pre"][l] = out[1][0].detach().clone()
            sh = kwargs["shared"]
            a = mod.self_attn
            if a.is_kv_source and sh.get("compress_kv") is not None:
                cap["cmain"][l] = sh["compress_kv"][0, 0].detach().clone()
                cap["kidx"][l] = sh["index_k"][0, 0].detach().clone()
            if a.is_index_source:
                t = sh.get("topk_idx")
                cap["topk"][l] = None if t is None else t[0].detach().clone()
                if a.indexer.is_candidate_source and sh.get("candidates") is not None:
                    cap["cand"][l] = sh["candidates"][0].detach().clone()
        hooks.append(layer.register_forward_hook(lay, with_kwargs=True))
        hooks.append(layer.self_attn.register_forward_hook(
            lambda m, a, o, l=l: cap["attn_out"].__setitem__(l, o[0][0].detach().clone())))
        if gaps and layer.self_attn.indexer is not None:
            def ixh(ix, args, out, l=l):
                hs, qr, _lat, _gp, pos, _cl, sh = args
                sc, blocks = indexer_scores(ix, hs, qr, pos, sh)
                if sc is None:
                    return
                k = min(ix.index_topk, sc.shape[-1])
                cap["idx_gap"][l] = float(_gap_at(sc[0], k).min())
                if blocks is not None:
                    nb = min(ix.candidate_topk_blocks, blocks.shape[-1]) - 1  # one slot taken by the pinned block
                    cap["cand_gap"][l] = float(_gap_at(blocks[0], nb).min()) if nb > 0 else float("inf")
            hooks.append(layer.self_attn.indexer.register_forward_hook(ixh))
        if gaps:
            def rh(g, args, out):
                logits = out[0]
                s = g.score_fn(logits) + g.e_score_correction_bias
                cap["router_gap"].append(float(_gap_at(s, g.top_k).min()))
            hooks.append(layer.mlp.gate.register_forward_hook(rh))
    if model.model.engram_hash_state is not None:
        hooks.append(model.model.engram_hash_state.register_forward_hook(
            lambda m, a, o: cap.__setitem__("hash", o[0].detach().clone())))
    qm = QuantMargins() if gaps else None
    try:
        with torch.no_grad():
            kw = dict(use_cache=cache is not None)
            if cache is not None:
                kw["past_key_values"] = cache
            if position_ids is not None:
                kw["position_ids"] = position_ids.view(1, -1)
            if qm is not None:
                with qm:
                    out = model(ids.view(1, -1), **kw)
            else:
                out = model(ids.view(1, -1), **kw)
    finally:
        for h in hooks:
            h.remove()
    cap["quant_fragile"] = None if qm is None else dict(qm.count)
    cap["logits"] = out.logits[0].detach().float().clone()
    cap["topk_sorted"] = {l: (None if t is None else _sorted_picks(t, cfg.index_topk)) for l, t in cap["topk"].items()}
    return cap


def min_gaps(cap: dict) -> dict:
    return {
        "indexer": min(cap["idx_gap"].values(), default=float("inf")),
        "candidate_blocks": min(cap["cand_gap"].values(), default=float("inf")),
        "router": min(cap["router_gap"], default=float("inf")),
        "quant_fragile": sum(cap["quant_fragile"].values()),
    }


def stream(model, ids: torch.Tensor, chunks: list[int]) -> dict:
    """ids through one DynamicCache in the given chunk sizes, explicit positions. Returns the
    concatenated logits and per-index-source ascending top-k picks [T, index_topk]."""
    cfg = model.config
    assert sum(chunks) == ids.numel()
    cache = DynamicCache(config=cfg)
    logits, picks, p = [], {}, 0
    for n in chunks:
        cap = run(model, ids[p:p + n], cache=cache, position_ids=torch.arange(p, p + n), gaps=False)
        logits.append(cap["logits"])
        for l, t in cap["topk_sorted"].items():
            if t is None:
                t = torch.full((n, cfg.index_topk), -1, dtype=torch.long)
            picks.setdefault(l, []).append(t)
        p += n
    return {"logits": torch.cat(logits), "topk": {l: torch.cat(v) for l, v in picks.items()}}
