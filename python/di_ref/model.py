"""A second, independent FP32 implementation of DeepSeek-V4 written from the spec text
(/work/shared/spec/deepseek-v4.md §2, R-HF numerics: no FP8/FP4 simulation), reading the
official-name tensors (spec §4.2). No transformers import.

Its purpose is to show that the spec, as written, reproduces HF transformers: gen_golden.py runs it
on every fixture and records the difference in meta.json. C code may cite the functions here as
the readable version of each step ("python/di_ref/model.py: hc_pre").

Shapes: one sequence, positions 0..T-1, `[T, ...]`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

SWA = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"

# ---- primitives (spec §2.0) ----


def yarn_range(n: int, theta: float, L0: int, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """YaRN correction range (low, high) with HF's truncate=True (floor/ceil), spec §2.0."""

    def corr(r):
        return n * math.log(L0 / (2 * math.pi * r)) / (2 * math.log(theta))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), n - 1)
    if low == high:
        high += 0.001
    return low, high


def rope_tables(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(main, compress) omega_i, float32, spec §2.0: base_i = theta^(-2i/n_rope); compress adds the
    YaRN blend base_i*(1-ramp) + base_i/factor*ramp."""
    n = cfg["qk_rope_head_dim"]

    def base(theta):
        i = np.arange(n // 2, dtype=np.float32)
        return (np.float32(1.0) / np.power(np.float32(theta), (2 * i / n).astype(np.float32))).astype(np.float32)

    rp = cfg["rope_parameters"]
    main = base(rp["main"]["rope_theta"])
    c = rp["compress"]
    comp = base(c["rope_theta"])
    if c.get("rope_type") == "yarn":
        low, high = yarn_range(n, c["rope_theta"], c["original_max_position_embeddings"],
                               c.get("beta_fast") or 32, c.get("beta_slow") or 1)
        i = np.arange(n // 2, dtype=np.float32)
        ramp = np.clip((i - low) / (high - low), 0, 1).astype(np.float32)
        comp = (comp * (1 - ramp) + (comp / np.float32(c["factor"])) * ramp).astype(np.float32)
    return torch.from_numpy(main), torch.from_numpy(comp)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def rope(v: torch.Tensor, pos: torch.Tensor, omega: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved partial RoPE on the last 2*len(omega) entries. v: [T, ..., n]; pos: [T]."""
    r = 2 * omega.shape[0]
    phi = pos.float()[:, None] * omega[None, :]  # [T, r/2], one FP32 product
    cos, sin = phi.cos(), phi.sin()
    if inverse:
        sin = -sin
    shape = (v.shape[0],) + (1,) * (v.dim() - 2) + (r // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    a, b = v[..., -r::2], v[..., -r + 1 :: 2]
    out = v.clone()
    out[..., -r::2] = a * cos - b * sin
    out[..., -r + 1 :: 2] = a * sin + b * cos
    return out


# ---- mHC (spec §2.3, §2.9) ----


def hc_pre(X, fn, scale, base, iters, hc_eps, eps):
    """X [T, NC, D] -> (a [T, D], post [T, NC], C [T, NC, NC])."""
    T, NC, D = X.shape
    xf = X.reshape(T, NC * D)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    mix = (xf @ fn.T) * r  # [T, (2+NC)*NC]
    pre = torch.sigmoid(mix[:, :NC] * scale[0] + base[:NC]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, NC : 2 * NC] * scale[1] + base[NC : 2 * NC])
    C = mix[:, 2 * NC :].view(T, NC, NC) * scale[2] + base[2 * NC :].view(NC, NC)
    C = torch.softmax(C, dim=-1) + hc_eps
    C = C / (C.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdim=True) + hc_eps)
        C = C / (C.sum(-2, keepdim=True) + hc_eps)
    a = (pre[:, :, None] * X).sum(1)
    return a, post, C


def hc_post(o, X, post, C):
    """X'[t, k] = post_k o[t] + sum_j C[j][k] X[t, j]."""
    return post[:, :, None] * o[:, None, :] + torch.einsum("tjk,tjd->tkd", C, X)


def hc_head(X, fn, scale, base, hc_eps, eps):
    T, NC, D = X.shape
    xf = X.reshape(T, NC * D)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid((xf @ fn.T) * r * scale[0] + base) + hc_eps
    return (pre[:, :, None] * X).sum(1)


# ---- compressor and indexer (spec §2.5, §2.6) ----


def compress(a, w, prefix, m, overlap, dh, omega, eps):
    """Entries for every complete window of a full sequence from position 0. -> [n_windows, dh]."""
    T = a.shape[0]
    Cv = a @ w[prefix + "wkv.weight"].T
    pos = torch.arange(T)
    Z = a @ w[prefix + "wgate.weight"].T + w[prefix + "ape"][pos % m]
    n = T // m
    out = []
    for win in range(n):
        sl = slice(win * m, (win + 1) * m)
        if overlap:
            vals, logits = [Cv[sl, dh:]], [Z[sl, dh:]]
            if win > 0:
                prev = slice((win - 1) * m, win * m)
                vals.insert(0, Cv[prev, :dh])
                logits.insert(0, Z[prev, :dh])
            vals, logits = torch.cat(vals), torch.cat(logits)
        else:
            vals, logits = Cv[sl], Z[sl]
        pooled = (torch.softmax(logits, dim=0) * vals).sum(0)  # per channel over the slots
        e = rms_norm(pooled, w[prefix + "norm.weight"], eps)
        out.append(rope(e[None], torch.tensor([win * m]), omega)[0])
    return torch.stack(out) if out else a.new_zeros(0, dh)


# ---- the model ----


class SpecModel:
    def __init__(self, cfg: dict, w: dict, shared_expert_clamp: bool = True):
        self.c = cfg
        self.w = {k: (v.float() if v.is_floating_point() else v) for k, v in w.items()}
        self.main_omega, self.comp_omega = rope_tables(cfg)
        self.shared_clamp = shared_expert_clamp

    # attention of one layer over a full sequence; returns (out [T, D], indexer picks or None)
    def attention(self, a, p, layer_type):
        c, w = self.c, self.w
        T = a.shape[0]
        H, Dh, eps = c["num_attention_heads"], c["head_dim"], c["rms_norm_eps"]
        W = c["sliding_window"]
        pos = torch.arange(T)
        omega = self.main_omega if layer_type == SWA else self.comp_omega
        qr = rms_norm(a @ w[p + "attn.wq_a.weight"].T, w[p + "attn.q_norm.weight"], eps)
        q = (qr @ w[p + "attn.wq_b.weight"].T).view(T, H, Dh)
        q = rope(rms_norm(q, None, eps), pos, omega)
        kv = rms_norm(a @ w[p + "attn.wkv.weight"].T, w[p + "attn.kv_norm.weight"], eps)
        kv = rope(kv, pos, omega)

        picks = None
        cmp = a.new_zeros(0, Dh)
        if layer_type != SWA:
            m = c["compress_rates"][layer_type]
            cmp = compress(a, w, p + "attn.compressor.", m, layer_type == CSA, Dh, self.comp_omega, eps)
        if layer_type == CSA:
            HI, DI, k_top = c["index_n_heads"], c["index_head_dim"], c["index_topk"]
            kidx = compress(a, w, p + "attn.indexer.compressor.", m, True, DI, self.comp_omega, eps)
            qi = rope((qr @ w[p + "attn.indexer.wq_b.weight"].T).view(T, HI, DI), pos, self.comp_omega)
            wi = (a @ w[p + "attn.indexer.weights_proj.weight"].T) * (DI**-0.5 * HI**-0.5)
            score = (wi[:, :, None] * F.relu(torch.einsum("thd,nd->thn", qi, kidx))).sum(1)  # [T, n]
            picks = []
            for t in range(T):
                vis = (t + 1) // m
                k = min(k_top, vis)
                picks.append(sorted(torch.topk(score[t, :vis], k).indices.tolist()) if k else [])

        o = torch.empty(T, H, Dh)
        scale = Dh**-0.5
        sink = w[p + "attn.attn_sink"]
        for t in range(T):
            keys = kv[max(0, t - W + 1) : t + 1]
            if layer_type == HCA:
                keys = torch.cat([keys, cmp[: (t + 1) // m]])
            elif layer_type == CSA:
                keys = torch.cat([keys, cmp[picks[t]]])
            logit = (q[t] @ keys.T) * scale  # [H, n]
            M = torch.maximum(logit.max(-1).values, sink)
            e = torch.exp(logit - M[:, None])
            den = e.sum(-1) + torch.exp(sink - M)
            o[t] = (e / den[:, None]) @ keys
        o = rope(o, pos, omega, inverse=True)
        G, Ro = c["o_groups"], c["o_lora_rank"]
        z = o.reshape(T, G, H * Dh // G)
        wo_a = w[p + "attn.wo_a.weight"].view(G, Ro, H * Dh // G)
        u = torch.einsum("tgi,goi->tgo", z, wo_a).reshape(T, G * Ro)
        return u @ w[p + "attn.wo_b.weight"].T, picks

    def moe(self, f, ids, p, is_hash):
        c, w = self.c, self.w
        L, K, E = c["swiglu_limit"], c["num_experts_per_tok"], c["n_routed_experts"]
        s = torch.sqrt(F.softplus(f @ w[p + "ffn.gate.weight"].T))  # [T, E]
        if is_hash:
            sel = w[p + "ffn.gate.tid2eid"][ids].long()
        else:
            sel = torch.topk(s + w[p + "ffn.gate.bias"], K, dim=-1).indices
        g = s.gather(1, sel)
        g = g / g.sum(-1, keepdim=True) * c["routed_scaling_factor"]

        def swiglu(x, pre, clamp=True):
            gt, up = x @ w[pre + "w1.weight"].T, x @ w[pre + "w3.weight"].T
            if clamp:
                up, gt = up.clamp(-L, L), gt.clamp(max=L)
            return (F.silu(gt) * up) @ w[pre + "w2.weight"].T

        y = torch.zeros_like(f)
        for e in range(E):
            rows, slot = torch.where(sel == e)
            if rows.numel():
                y[rows] += g[rows, slot, None] * swiglu(f[rows], f"{p}ffn.experts.{e}.")
        return y + swiglu(f, p + "ffn.shared_experts.", self.shared_clamp)

    def block(self, X, ids, p, layer_type, is_hash):
        c, w = self.c, self.w
        it, he, eps = c["hc_sinkhorn_iters"], c["hc_eps"], c["rms_norm_eps"]
        a, post, C = hc_pre(X, w[p + "hc_attn_fn"], w[p + "hc_attn_scale"], w[p + "hc_attn_base"], it, he, eps)
        o, picks = self.attention(rms_norm(a, w[p + "attn_norm.weight"], eps), p, layer_type)
        X = hc_post(o, X, post, C)
        f, post, C = hc_pre(X, w[p + "hc_ffn_fn"], w[p + "hc_ffn_scale"], w[p + "hc_ffn_base"], it, he, eps)
        y = self.moe(rms_norm(f, w[p + "ffn_norm.weight"], eps), ids, p, is_hash)
        return hc_post(y, X, post, C), o, picks

    def forward(self, ids: torch.Tensor) -> dict:
        c, w = self.c, self.w
        eps, he = c["rms_norm_eps"], c["hc_eps"]
        X = w["embed.weight"][ids][:, None, :].repeat(1, c["hc_mult"], 1)
        out = {}
        for l in range(c["num_hidden_layers"]):
            X, o, picks = self.block(X, ids, f"layers.{l}.", c["layer_types"][l], c["mlp_layer_types"][l] == "hash_moe")
            out[f"layer_out.{l}"], out[f"attn_out.{l}"] = X, o
            if picks is not None:
                out[f"indexer_topk.{l}"] = picks
        h = hc_head(X, w["hc_head_fn"], w["hc_head_scale"], w["hc_head_base"], he, eps)
        out["logits"] = rms_norm(h, w["norm.weight"], eps) @ w["head.weight"].T
        # MTP (spec §2.10): position t reads X[t] and embed(ids[t+1]).
        p = "mtp.0."
        if p + "e_proj.weight" in w:
            e = rms_norm(w["embed.weight"][ids[1:]], w[p + "enorm.weight"], eps)
            hX = rms_norm(X[:-1], w[p + "hnorm.weight"], eps)
            X0 = (e @ w[p + "e_proj.weight"].T)[:, None, :] + hX @ w[p + "h_proj.weight"].T
            X1, _o, _ = self.block(X0, None, p, SWA, False)
            h = hc_head(X1, w[p + "hc_head_fn"], w[p + "hc_head_scale"], w[p + "hc_head_base"], he, eps)
            out["mtp_logits"] = rms_norm(h, w[p + "norm.weight"], eps) @ w["head.weight"].T
        return out
