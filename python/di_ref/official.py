"""Official-layout (DeepSeek naming, FP8/FP4) variant of a tiny checkpoint (spec §4.1-§4.3).

* FP8 e4m3 weights with 128x128 UE8M0 `.scale` tensors for wq_a, wq_b, wkv, wo_a, wo_b,
  indexer.wq_b, shared_experts.w1/w2/w3, mtp e_proj/h_proj.
  scale = 2^ceil_log2(fl32(amax * fl32(1/448))) per block (power of two, amax <= 448 * scale),
  code = e4m3_RNE(clamp(w / scale, -448, 448)).
* Routed experts FP4 e2m1, packed two per int8 byte along the input axis (low nibble = even
  index), 1x32 UE8M0 scales: scale = 2^ceil_log2(fl32(amax * fl32(1/6))), code = e2m1_RNE(w / scale)
  (ties to the even code), stored per expert as `layers.L.ffn.experts.E.w{1,2,3}.weight` + `.scale`.
* Everything else in the §4.2 dtypes: BF16 norms / embed / head / compressor projections / gate /
  weights_proj; F32 hc_*, attn_sink, ape, gate.bias; I64 tid2eid.

`dequantise()` turns the file's tensors back into float values (spec §4.3), which are loaded into
an HF model to give the "official" reference logits.
"""

from __future__ import annotations

import json
import os

import torch

from . import dump

FP8_NAMES = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "attn.indexer.wq_b.weight",
    "ffn.shared_experts.w1.weight",
    "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight",
    "e_proj.weight",
    "h_proj.weight",
)
F32_NAMES = (
    "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
    "hc_head_fn", "hc_head_base", "hc_head_scale",
    "attn.attn_sink", "attn.compressor.ape", "attn.indexer.compressor.ape", "ffn.gate.bias",
)

QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ---- scalar formats ----


def ceil_log2_f32(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) for positive normal FP32 x, from the bit pattern (spec §2.0):
    exponent - 127 + (mantissa != 0)."""
    bits = x.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    assert bool((exp > 0).all() and (exp < 255).all()), "ceil_log2 needs positive normal floats"
    return exp - 127 + (man != 0).to(torch.int32)


def ue8m0_encode(e: torch.Tensor) -> torch.Tensor:
    """Power-of-two exponent e -> UE8M0 byte (value 2^(u-127))."""
    u = e + 127
    assert bool((u >= 0).all() and (u <= 254).all())
    return u.to(torch.uint8)


def ue8m0_decode(u: torch.Tensor) -> torch.Tensor:
    assert bool((u != 255).all()), "UE8M0 NaN"
    return (u.to(torch.int32) << 23).view(torch.float32)  # FP32 with bits u << 23


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    """spec §4.3, written out (independent of torch's float8 type)."""
    b = b.to(torch.int32)
    s = (b >> 7) & 1
    e = (b >> 3) & 0xF
    f = (b & 7).float()
    mag = torch.where(e == 0, f / 8 * 2.0**-6, (1 + f / 8) * torch.pow(2.0, (e - 7).float()))
    assert bool(((b & 0x7F) != 0x7F).all()), "e4m3 NaN"
    return torch.where(s == 1, -mag, mag)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 (|x| <= 448) -> e4m3fn bytes, round-to-nearest-even (torch's float8_e4m3fn cast,
    checked against the spec's known answers in self_test())."""
    x = x.float().clamp(-448.0, 448.0)
    return x.to(torch.float8_e4m3fn).view(torch.uint8)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e2m1 codes (uint8, 0..15): clamp to +-6, nearest grid value, ties to the even
    code; sign bit only for nonzero magnitudes."""
    a = x.float().abs().clamp(max=6.0)
    d = (a.unsqueeze(-1) - E2M1_GRID).abs()  # [..., 8]
    dmin = d.min(dim=-1, keepdim=True).values
    is_min = d == dmin
    idx = torch.arange(8)
    # Among the (at most two) nearest codes prefer the even one.
    even_pick = (is_min & (idx % 2 == 0)).to(torch.int64).argmax(-1)
    any_even = (is_min & (idx % 2 == 0)).any(-1)
    code = torch.where(any_even, even_pick, is_min.to(torch.int64).argmax(-1))
    sign = ((x < 0) & (code != 0)).to(torch.int64)
    return (code | (sign << 3)).to(torch.uint8)


def e2m1_decode(c: torch.Tensor) -> torch.Tensor:
    c = c.to(torch.int64)
    mag = E2M1_GRID[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


# ---- block quantisation ----


def quant_fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] float -> (codes uint8 [O, I], scale bytes uint8 [ceil(O/128), ceil(I/128)])."""
    O, I = w.shape
    nO, nI = -(-O // block), -(-I // block)
    wp = torch.zeros(nO * block, nI * block)
    wp[:O, :I] = w.float()
    blocks = wp.view(nO, block, nI, block).permute(0, 2, 1, 3)  # [nO, nI, b, b]
    amax = blocks.abs().amax(dim=(-1, -2)).clamp(min=1e-4)
    e = ceil_log2_f32(amax * torch.tensor(1.0 / 448.0, dtype=torch.float32))
    s = torch.pow(2.0, e.float())
    q = blocks / s[:, :, None, None]
    codes = e4m3_encode(q).permute(0, 2, 1, 3).reshape(nO * block, nI * block)[:O, :I].contiguous()
    return codes, ue8m0_encode(e)


def dequant_fp8_block(codes: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    s = ue8m0_decode(scale)
    s_full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[: codes.shape[0], : codes.shape[1]]
    return e4m3_decode(codes) * s_full


def quant_fp4_rows(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] float (I % 32 == 0) -> (packed int8 [O, I/2], scale bytes uint8 [O, I/32])."""
    O, I = w.shape
    assert I % block == 0 and I % 2 == 0
    blocks = w.float().view(O, I // block, block)
    amax = blocks.abs().amax(-1).clamp(min=6.0 * 2.0**-126)
    e = ceil_log2_f32(amax * torch.tensor(1.0 / 6.0, dtype=torch.float32))
    s = torch.pow(2.0, e.float())
    codes = e2m1_encode(blocks / s[..., None]).view(O, I)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # low nibble = even index
    return packed.view(torch.int8), ue8m0_encode(e)


def dequant_fp4_rows(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    p = packed.view(torch.uint8).to(torch.int64)
    O = p.shape[0]
    codes = torch.stack([p & 0xF, (p >> 4) & 0xF], dim=-1).view(O, -1)  # even, odd
    s = ue8m0_decode(scale).repeat_interleave(block, 1)
    return e2m1_decode(codes) * s


# ---- whole checkpoint ----


def _kind(name: str) -> str:
    """Storage kind of an official-name tensor (spec §4.2)."""
    base = name
    if name.startswith("mtp.0."):
        base = name[len("mtp.0."):]
    elif name.startswith("layers."):
        base = name.split(".", 2)[2]
    if base.startswith("ffn.experts.") and base.endswith(".weight"):
        return "fp4"
    if base in FP8_NAMES:
        return "fp8"
    if base == "ffn.gate.tid2eid":
        return "i64"
    if base in F32_NAMES:
        return "f32"
    return "bf16"


def quantise(official_sd: dict) -> dict:
    """official-name float tensors -> {name: (dtype_str, tensor)} as stored in the file."""
    out = {}
    for name, t in official_sd.items():
        k = _kind(name)
        if k == "fp8":
            codes, sc = quant_fp8_block(t)
            out[name] = ("F8_E4M3", codes)
            out[name[: -len(".weight")] + ".scale"] = ("F8_E8M0", sc)
        elif k == "fp4":
            packed, sc = quant_fp4_rows(t)
            out[name] = ("I8", packed)
            out[name[: -len(".weight")] + ".scale"] = ("F8_E8M0", sc)
        elif k == "i64":
            out[name] = ("I64", t.to(torch.int64))
        elif k == "f32":
            out[name] = ("F32", t.float())
        else:
            bf = t.to(torch.bfloat16)
            assert torch.equal(bf.float(), t.float()), f"{name} not bf16-representable"
            out[name] = ("BF16", bf)
    return out


def dequantise(stored: dict) -> dict:
    """{name: (dtype_str, tensor)} -> official-name float32 tensors (and int64 tid2eid)."""
    out = {}
    for name, (dt, t) in stored.items():
        if name.endswith(".scale") and dt == "F8_E8M0":
            continue
        if dt == "F8_E4M3":
            out[name] = dequant_fp8_block(t, stored[name[: -len(".weight")] + ".scale"][1])
        elif dt == "I8":
            out[name] = dequant_fp4_rows(t, stored[name[: -len(".weight")] + ".scale"][1])
        elif dt == "I64":
            out[name] = t
        else:
            out[name] = t.float()
    return out


def write(directory: str, hf_config: dict, stored: dict) -> None:
    """config.json (HF config + quantization_config + expert_dtype) and model.safetensors."""
    os.makedirs(directory, exist_ok=True)
    cfg = dict(hf_config)
    cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
    cfg["expert_dtype"] = "fp4"
    cfg["dtype"] = "bfloat16"
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    dump.write_safetensors(
        os.path.join(directory, "model.safetensors"),
        {n: (dt, t) for n, (dt, t) in stored.items()},
        metadata={"format": "pt"},
    )


def self_test() -> dict:
    """Known answers from spec §6.5 / §4.3; raises on failure."""
    # e4m3 RNE: 1.0625 -> 1.0, 1.1875 -> 1.25, 440 -> 448, 0.002 -> 0.001953125, -0.9 -> -0.875
    x = torch.tensor([1.0625, 1.1875, 440.0, 0.002, -0.9])
    got = e4m3_decode(e4m3_encode(x))
    assert got.tolist() == [1.0, 1.25, 448.0, 0.001953125, -0.875], got.tolist()
    # All 254 non-NaN e4m3 codes: torch's cast decodes like §4.3 and re-encodes to itself.
    codes = torch.tensor([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=torch.uint8)
    dec = e4m3_decode(codes)
    assert torch.equal(dec, codes.view(torch.float8_e4m3fn).float())
    nz = codes[(codes != 0x80)]
    assert torch.equal(e4m3_encode(e4m3_decode(nz)), nz)
    # Q8 known answers (block of 4): scale 2^-10 and 1.
    for v, want in (([0.1, -0.2, 0.3, 0.4], [0.1015625, -0.203125, 0.3125, 0.40625]),
                    ([448.0, 1.0, -3.0, 0.001], [448.0, 1.0, -3.0, 0.001953125])):
        c, s = quant_fp8_block(torch.tensor([v]), block=4)
        assert dequant_fp8_block(c, s, block=4)[0].tolist() == want, (v, dequant_fp8_block(c, s, block=4))
    c, s = quant_fp8_block(torch.zeros(1, 4), block=4)
    assert int(s[0, 0]) == 127 - 22
    # Q4 known answers (spec §6.5, blocks of 4 and 6).
    for v, scale, want in (([3.0, -1.0, 0.2, 0.7], 0.5, [3.0, -1.0, 0.25, 0.75]),
                           ([5.0, 2.5, 0.25, 0.75, 1.25, -6.0], 1.0, [4.0, 2.0, 0.0, 1.0, 1.0, -6.0])):
        p, s = quant_fp4_rows(torch.tensor([v]), block=len(v))
        assert float(ue8m0_decode(s)[0, 0]) == scale
        assert dequant_fp4_rows(p, s, block=len(v))[0].tolist() == want
    # Packing: low nibble = even index.
    p, s = quant_fp4_rows(torch.tensor([[1.0, -2.0] + [0.0] * 30]))
    # amax 2 -> scale 0.5: 1.0 -> +2.0 (code 4, low nibble), -2.0 -> -4.0 (code 0xE, high nibble)
    assert int(p.view(torch.uint8)[0, 0]) == (0x4 | (0xE << 4)), hex(int(p.view(torch.uint8)[0, 0]))
    return {"e4m3_codes_checked": int(codes.numel()), "known_answers": "spec §6.5 Q8/Q4 + §4.3 packing: ok"}

