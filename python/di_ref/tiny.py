"""Tiny random-weight DeepSeek-V4 checkpoints for the reference fixtures.

Builds an HF `DeepseekV4ForCausalLM` (FP32, CPU, eval, eager attention) from one of the config
presets below, randomises everything HF initialises to a constant (spec §5 pitfall 22, §6.3 step 2),
builds the MTP block HF does not have (spec §6.4), and rounds every floating parameter to a
bfloat16-representable value so the same weights can be stored as BF16 without loss.

Also owns the HF-module-name <-> official-name table (spec §4.2 / §4.5), used for the MTP file and
for the official-layout checkpoint (official.py).
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl

SWA = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"

# Exact V4 rope (spec §6.2): the nested form bypasses the config's own conversion, so every
# sub-dict carries its own partial_rotary_factor and `compress` carries attention_factor = 1.0.
ROPE_PARAMETERS = {
    "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "compress": {
        "rope_type": "yarn",
        "rope_theta": 160000.0,
        "partial_rotary_factor": 0.5,
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": 1.0,
    },
}

# spec §6.2, verbatim except swiglu_limit (tuned per fixture).
TINY = dict(
    vocab_size=512,
    hidden_size=128,
    num_hidden_layers=6,
    layer_types=[SWA, CSA, HCA, CSA, HCA, SWA],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 8},
    sliding_window=16,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=128,
    partial_rotary_factor=0.5,
    q_lora_rank=128,
    o_groups=2,
    o_lora_rank=128,
    index_n_heads=4,
    index_head_dim=128,
    index_topk=3,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=128,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    swiglu_limit=1.0,  # ~20 % of gate/up values clamp with this init (measured; spec guessed 0.3)
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rms_norm_eps=1e-6,
    rope_parameters=ROPE_PARAMETERS,
    max_position_embeddings=4096,
    num_nextn_predict_layers=1,
    initializer_range=0.08,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)


def _preset(**over):
    d = copy.deepcopy(TINY)
    d.update(copy.deepcopy(over))
    return d


# Config presets. Names are the fixture names; `unseen_*` are only used by check_unseen.py.
PRESETS = {
    # (a) spec §6.2 exactly; swiglu_limit tuned so 10-30 % of gate/up values clamp.
    "tiny": _preset(),
    # (b) smaller, no clamping in practice (swiglu_limit 10); the FP32 fixture.
    "tiny_limit10": _preset(
        vocab_size=128,
        num_hidden_layers=2,
        layer_types=[CSA, HCA],
        mlp_layer_types=["hash_moe", "moe"],
        num_attention_heads=2,
        n_routed_experts=3,
        swiglu_limit=10.0,
    ),
    # (c) real HCA ratio 128; T = 320 closes two 128-windows.
    "hca128": _preset(
        vocab_size=128,
        num_hidden_layers=3,
        layer_types=[HCA, SWA, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 128},
        num_attention_heads=2,
        o_groups=1,
        index_n_heads=8,
        n_routed_experts=3,
    ),
    # (d) index_topk 2: the indexer's top-k bites from position 11 on; three CSA layers.
    "topk": _preset(
        vocab_size=128,
        num_hidden_layers=3,
        layer_types=[CSA, CSA, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        num_attention_heads=2,
        index_n_heads=8,
        index_topk=2,
        n_routed_experts=3,
    ),
    # (e) V4-Pro-like schedule: HCA, HCA, then CSA/HCA alternating, no SWA in the main stack,
    # hash routing on layers 0-2 (layer 2 is CSA), MTP is SWA.
    "pro_like": _preset(
        vocab_size=128,
        num_hidden_layers=4,
        layer_types=[HCA, HCA, CSA, HCA],
        mlp_layer_types=["hash_moe", "hash_moe", "hash_moe", "moe"],
        compress_rates={CSA: 4, HCA: 16},
        index_n_heads=8,
        n_routed_experts=3,
    ),
    # check_unseen.py only: variations not among the fixtures.
    "unseen_mixed": _preset(
        vocab_size=384,
        num_hidden_layers=5,
        layer_types=[CSA, SWA, HCA, CSA, HCA],
        mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe", "moe"],
        compress_rates={CSA: 4, HCA: 16},
        sliding_window=8,
        index_topk=4,
        n_routed_experts=6,
        num_experts_per_tok=3,
        swiglu_limit=0.5,
        routed_scaling_factor=2.5,
    ),
    "unseen_wide": _preset(
        vocab_size=320,
        hidden_size=256,
        num_hidden_layers=3,
        layer_types=[HCA, CSA, SWA],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        num_attention_heads=8,
        o_groups=4,
        index_n_heads=8,
        index_topk=5,
        n_routed_experts=4,
        swiglu_limit=1.0,
    ),
}


def make_config(preset: str | dict, **overrides) -> DeepseekV4Config:
    """DeepseekV4Config from a preset name or a kwargs dict, eager attention, eager experts."""
    kw = copy.deepcopy(PRESETS[preset] if isinstance(preset, str) else preset)
    kw.update(copy.deepcopy(overrides))
    cfg = DeepseekV4Config(**kw)
    cfg._attn_implementation = "eager"  # the only supported backend
    # The module's own readable loop (grouped_mm would be picked by default on CPU).
    cfg._experts_implementation = "eager"
    # The explicit lists must have survived __post_init__ unchanged (spec §1.1).
    assert cfg.layer_types == kw["layer_types"], cfg.layer_types
    assert cfg.mlp_layer_types == kw["mlp_layer_types"], cfg.mlp_layer_types
    assert cfg.rope_parameters["compress"]["attention_factor"] == 1.0
    return cfg


# ---- randomisation ----


def _normal_(t: torch.Tensor, g: torch.Generator, mean: float, std: float) -> None:
    t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32) * std + mean)


def randomise_constants_(module: nn.Module, cfg: DeepseekV4Config, g: torch.Generator) -> None:
    """spec §6.3 step 2: give every constant-initialised tensor random values."""
    with torch.no_grad():
        for name, m in module.named_modules():
            if isinstance(m, mdl.DeepseekV4Attention):
                _normal_(m.sinks, g, 0.0, 1.0)
            if isinstance(m, (mdl.DeepseekV4HCACompressor, mdl.DeepseekV4CSACompressor, mdl.DeepseekV4Indexer)):
                _normal_(m.position_bias, g, 0.0, 0.5)
            if isinstance(m, mdl.DeepseekV4HyperConnection):
                _normal_(m.base, g, 0.0, 0.5)
                _normal_(m.scale, g, 1.0, 0.2)
            if isinstance(m, mdl.DeepseekV4HyperHead):
                _normal_(m.hc_base, g, 0.0, 0.5)
                _normal_(m.hc_scale, g, 1.0, 0.2)
            if isinstance(m, mdl.DeepseekV4RMSNorm):
                _normal_(m.weight, g, 1.0, 0.1)
            if isinstance(m, mdl.DeepseekV4TopKRouter):
                _normal_(m.e_score_correction_bias, g, 0.0, 0.1)
            if isinstance(m, mdl.DeepseekV4HashRouter):
                E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
                rows = [torch.randperm(E, generator=g)[:K] for _ in range(m.tid2eid.shape[0])]
                m.tid2eid.copy_(torch.stack(rows).to(m.tid2eid.dtype))


def round_to_bf16_(module: nn.Module) -> None:
    """Make every floating parameter (and the persistent float buffer e_score_correction_bias)
    bfloat16-representable, in place. The non-persistent RoPE inv_freq buffers are left alone."""
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                p.copy_(p.bfloat16().float())
        for m in module.modules():
            if isinstance(m, mdl.DeepseekV4TopKRouter):
                b = m.e_score_correction_bias
                b.copy_(b.bfloat16().float())


def _init_normal_params_(module: nn.Module, g: torch.Generator, std: float) -> None:
    """HF-like init for a freshly built (torch.empty) module: every parameter N(0, std);
    randomise_constants_ then overrides the ones HF would set to constants."""
    with torch.no_grad():
        for p in module.parameters():
            _normal_(p, g, 0.0, std)


# ---- MTP (spec §2.10, §6.4) ----


def mtp_config(cfg: DeepseekV4Config) -> DeepseekV4Config:
    """Config copy whose layer `num_hidden_layers` is SWA + score-routed MoE (the MTP block)."""
    c = copy.deepcopy(cfg)
    n = cfg.num_hidden_layers
    # Direct attribute writes: re-running __post_init__ would truncate the lists to n.
    c.num_hidden_layers = n + 1
    c.layer_types = list(cfg.layer_types) + [SWA]
    c.mlp_layer_types = list(cfg.mlp_layer_types) + ["moe"]
    return c


class MTPBlock(nn.Module):
    """One MTP block from HF building blocks (spec §6.4). Uses the main model's embed_tokens,
    rotary_emb and lm_head (shared), owns everything else."""

    def __init__(self, cfg: DeepseekV4Config):
        super().__init__()
        D = cfg.hidden_size
        self.layer_idx = cfg.num_hidden_layers
        self.cfg = mtp_config(cfg)
        self.enorm = mdl.DeepseekV4RMSNorm(D, eps=cfg.rms_norm_eps)
        self.hnorm = mdl.DeepseekV4RMSNorm(D, eps=cfg.rms_norm_eps)
        self.norm = mdl.DeepseekV4RMSNorm(D, eps=cfg.rms_norm_eps)
        self.e_proj = nn.Linear(D, D, bias=False)
        self.h_proj = nn.Linear(D, D, bias=False)
        self.block = mdl.DeepseekV4DecoderLayer(self.cfg, self.layer_idx)
        self.hc_head = mdl.DeepseekV4HyperHead(cfg)
        assert self.block.self_attn.compressor is None and not self.block.mlp.is_hash

    def forward(self, model: DeepseekV4ForCausalLM, x_main: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """x_main: [B, T', NC, D] main-stack streams after the last decoder layer (before hc_head);
        next_ids: [B, T'] = ids[1:]. Returns MTP logits [B, T', V] (row t predicts token t+2)."""
        B, Tp = next_ids.shape
        e = self.enorm(model.model.embed_tokens(next_ids))  # [B, T', D]
        h = self.hnorm(x_main)  # per stream over D: [B, T', NC, D]
        x = self.e_proj(e).unsqueeze(2) + self.h_proj(h)  # [B, T', NC, D]
        pos = torch.arange(Tp).unsqueeze(0).expand(B, -1)
        pe = {
            "main": model.model.rotary_emb(e, position_ids=pos, layer_type="main"),
            "compress": model.model.rotary_emb(e, position_ids=pos, layer_type="compress"),
        }
        q = torch.arange(Tp).view(-1, 1)
        k = torch.arange(Tp).view(1, -1)
        visible = (q - k >= 0) & (q - k < self.cfg.sliding_window)
        mask = torch.zeros(Tp, Tp).masked_fill(~visible, float("-inf")).view(1, 1, Tp, Tp).to(x.dtype)
        x = self.block(
            x, input_ids=None, position_embeddings=pe, position_ids=pos, attention_mask=mask, cache=None
        )
        h = self.norm(self.hc_head(x))
        return model.lm_head(h)


# ---- build ----


def build(cfg: DeepseekV4Config, seed: int) -> tuple[DeepseekV4ForCausalLM, MTPBlock]:
    """Random model + MTP block, FP32, CPU, eval, all floats bf16-representable."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    assert model.config._attn_implementation == "eager"
    assert model.config._experts_implementation == "eager", model.config._experts_implementation
    g = torch.Generator().manual_seed(seed * 7919 + 1)
    randomise_constants_(model, cfg, g)
    round_to_bf16_(model)
    # spec §6.3 step 1: untied even though the class declares a tie map.
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)

    mtp = MTPBlock(cfg).float().eval()
    _init_normal_params_(mtp, g, cfg.initializer_range)
    randomise_constants_(mtp, cfg, g)
    round_to_bf16_(mtp)
    return model, mtp


def random_ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g)


# ---- names: HF module tree <-> official (spec §4.2, §4.5) ----

# Suffix renames inside one decoder layer, HF -> official. Applied as exact-prefix matches.
_LAYER_MAP = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"),
    ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"),
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
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
    # mlp.experts.gate_up_proj / down_proj are split per expert in _layer_to_official.
]
_TOP_MAP = [
    ("model.embed_tokens.weight", "embed.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.hc_head.hc_base", "hc_head_base"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
]
_MTP_MAP = [
    ("enorm.weight", "enorm.weight"),
    ("hnorm.weight", "hnorm.weight"),
    ("norm.weight", "norm.weight"),
    ("e_proj.weight", "e_proj.weight"),
    ("h_proj.weight", "h_proj.weight"),
    ("hc_head.hc_fn", "hc_head_fn"),
    ("hc_head.hc_base", "hc_head_base"),
    ("hc_head.hc_scale", "hc_head_scale"),
]


def _layer_to_official(sd: dict, hf_prefix: str, off_prefix: str, out: dict) -> None:
    F = None
    for hf, off in _LAYER_MAP:
        if hf_prefix + hf in sd:
            out[off_prefix + off] = sd[hf_prefix + hf]
    gu = sd[hf_prefix + "mlp.experts.gate_up_proj"]  # [E, 2F, D], rows 0..F-1 = gate (w1)
    dn = sd[hf_prefix + "mlp.experts.down_proj"]  # [E, D, F]
    F = gu.shape[1] // 2
    for e in range(gu.shape[0]):
        out[f"{off_prefix}ffn.experts.{e}.w1.weight"] = gu[e, :F].contiguous()
        out[f"{off_prefix}ffn.experts.{e}.w3.weight"] = gu[e, F:].contiguous()
        out[f"{off_prefix}ffn.experts.{e}.w2.weight"] = dn[e].contiguous()


def _n_official(sd: dict) -> int:
    """Number of official tensors an HF state dict maps to (stacked experts split per expert)."""
    n = 0
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            n += 2 * v.shape[0]
        elif k.endswith("mlp.experts.down_proj"):
            n += v.shape[0]
        else:
            n += 1
    return n


def official_state_dict(model: DeepseekV4ForCausalLM, mtp: MTPBlock | None) -> dict:
    """Full official-name state dict (float tensors as in the model, tid2eid int64)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {}
    for hf, off in _TOP_MAP:
        out[off] = sd[hf]
    for l in range(model.config.num_hidden_layers):
        _layer_to_official(sd, f"model.layers.{l}.", f"layers.{l}.", out)
    if mtp is not None:
        out.update(mtp_official_state_dict(mtp))
    n_hf = _n_official(sd)
    n_main = sum(1 for k in out if not k.startswith("mtp."))
    assert n_main == n_hf, (n_main, n_hf)  # every HF tensor mapped exactly once
    return out


def mtp_official_state_dict(mtp: MTPBlock) -> dict:
    sd = {k: v.detach() for k, v in mtp.state_dict().items()}
    out = {}
    for hf, off in _MTP_MAP:
        out["mtp.0." + off] = sd[hf]
    _layer_to_official(sd, "block.", "mtp.0.", out)
    n_expect = _n_official(sd)
    assert len(out) == n_expect, (len(out), n_expect)
    return out


def load_official_into_(model: DeepseekV4ForCausalLM, mtp: MTPBlock, off: dict) -> None:
    """Inverse of official_state_dict: copy official-name float tensors into the HF modules."""
    msd = model.state_dict()
    tsd = mtp.state_dict()
    target = {}
    for hf, o in _TOP_MAP:
        target[hf] = off[o]
    for l in range(model.config.num_hidden_layers):
        _official_to_layer(off, f"layers.{l}.", f"model.layers.{l}.", msd, target)
    for hf, o in _MTP_MAP:
        target["mtp:" + hf] = off["mtp.0." + o]
    _official_to_layer(off, "mtp.0.", "mtp:block.", {("mtp:" + k): v for k, v in tsd.items()}, target)
    with torch.no_grad():
        for k, v in target.items():
            if k.startswith("mtp:"):
                dst = tsd[k[4:]]
            else:
                dst = msd[k]
            assert dst.shape == v.shape, (k, dst.shape, v.shape)
            dst.copy_(v.to(dst.dtype))
    assert all(k in target for k in msd if "inv_freq" not in k), [k for k in msd if k not in target]
    assert all(("mtp:" + k) in target for k in tsd if "inv_freq" not in k)


def _official_to_layer(off: dict, off_prefix: str, hf_prefix: str, hf_sd: dict, target: dict) -> None:
    for hf, o in _LAYER_MAP:
        if off_prefix + o in off:
            assert hf_prefix + hf in hf_sd, hf_prefix + hf
            target[hf_prefix + hf] = off[off_prefix + o]
    E = 0
    while f"{off_prefix}ffn.experts.{E}.w1.weight" in off:
        E += 1
    w1 = [off[f"{off_prefix}ffn.experts.{e}.w1.weight"] for e in range(E)]
    w3 = [off[f"{off_prefix}ffn.experts.{e}.w3.weight"] for e in range(E)]
    w2 = [off[f"{off_prefix}ffn.experts.{e}.w2.weight"] for e in range(E)]
    target[hf_prefix + "mlp.experts.gate_up_proj"] = torch.stack([torch.cat([a, b], 0) for a, b in zip(w1, w3)])
    target[hf_prefix + "mlp.experts.down_proj"] = torch.stack(w2)


def config_summary(cfg: DeepseekV4Config) -> dict:
    keys = [
        "vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "mlp_layer_types", "compress_rates",
        "sliding_window", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups",
        "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
        "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor", "swiglu_limit", "hc_mult",
        "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "rope_parameters", "initializer_range",
    ]
    return {k: copy.deepcopy(getattr(cfg, k)) for k in keys}



def saved_to_official(sd: dict) -> dict:
    """Tensors as a checkpoint file names them -> official names. Accepts the three namings met in
    practice: official (`embed.weight`, `layers.N.attn.kv_norm.weight`), what transformers
    5.x save_pretrained writes (`model.`-prefixed official names with `head.weight`,
    `model.embed_tokens.weight`, `model.norm.weight`, `model.hc_head.hc_*`, and
    `attn.norm.weight` for the attention kv_norm), and HF module-tree names (state_dict())."""
    out = {}
    hf_layer = dict(_LAYER_MAP)
    top = dict(_TOP_MAP)
    for k, v in sd.items():
        if k in top:  # HF module names / save_pretrained top-level names
            out[top[k]] = v
            continue
        if k == "head.weight" or k.startswith("mtp.") or k.startswith("layers.") or k in (
            "embed.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"
        ):
            out[k] = v
            continue
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", k)
        assert m, f"unrecognised tensor name {k}"
        l, rest = m.group(1), m.group(2)
        if rest.startswith("mlp.experts.gate_up_proj"):
            F = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"layers.{l}.ffn.experts.{e}.w1.weight"] = v[e, :F]
                out[f"layers.{l}.ffn.experts.{e}.w3.weight"] = v[e, F:]
            continue
        if rest.startswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"layers.{l}.ffn.experts.{e}.w2.weight"] = v[e]
            continue
        if rest in hf_layer:
            rest = hf_layer[rest]
        elif rest == "attn.norm.weight":  # save_pretrained's reverse rename of self_attn.kv_norm
            rest = "attn.kv_norm.weight"
        out[f"layers.{l}.{rest}"] = v
    return out
