"""Float64 references of the LFM mixers' ``"full"`` operators, written from the formulas with
numpy (nothing shared with ``block``): the gated short conv's ``diag(c) M diag(b)`` entry by
entry, and the attention's softmax probabilities with its own RoPE."""
from __future__ import annotations

import numpy as np


def conv_operator(p: dict, x, cfg):
    """``H (B, D, L, L)``: ``H[c, i, j] = c_i w[c, K-1-(i-j)] b_j`` for ``0 <= i - j < K``."""
    B, L, D = x.shape
    bcx = x @ p["in_proj.weight"].T + p.get("in_proj.bias", 0.0)
    b, c = bcx[..., :D].transpose(0, 2, 1), bcx[..., D:2 * D].transpose(0, 2, 1)
    w = p["conv.weight"][:, 0, :]
    K = w.shape[-1]
    H = np.zeros((B, D, L, L))
    for i in range(L):
        for j in range(max(0, i - K + 1), i + 1):
            H[:, :, i, j] = c[:, :, i] * w[None, :, K - 1 - (i - j)] * b[:, :, j]
    return H


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def frequencies(cfg, kind: str):
    """RoPE frequencies ``(d/2,)``: ``theta^(-2i/d)``; LFM3's full attention (proportional) keeps
    the first ``int(f d / 2)`` of them and zeroes the rest, divided by its factor."""
    d = cfg.head_dim
    theta, keep, factor = cfg.rope_theta, d // 2, 1.0
    if cfg.model_type == "lfm3":
        if kind == "sliding":
            theta = cfg.sliding_rope_theta
        elif cfg.rope_type == "proportional":
            keep, factor = int(cfg.partial_rotary_factor * d // 2), cfg.rope_factor
    inv = theta ** (-np.arange(0, d, 2) / d)
    inv[keep:] = 0.0
    return inv / factor


def attention_operator(p: dict, x, cfg, kind: str, inv=None):
    """Softmax probabilities ``(B, heads, L, L)`` (causal, within the sliding window if any).
    ``inv``: the RoPE frequencies ``(d/2,)`` (zero: no rotation of that pair); default
    ``frequencies(cfg, kind)``."""
    B, L, _ = x.shape
    H, KV, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    names = cfg.attention_names
    q = rms((x @ p["q_proj.weight"].T + p.get("q_proj.bias", 0.0)).reshape(B, L, H, d), p[names["q_norm"]],
            cfg.norm_eps)
    k = rms((x @ p["k_proj.weight"].T + p.get("k_proj.bias", 0.0)).reshape(B, L, KV, d), p[names["k_norm"]],
            cfg.norm_eps)
    ang = np.arange(L)[:, None] * (frequencies(cfg, kind) if inv is None else inv)[None]
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]

    def rope(t):
        a, b = t[..., :d // 2], t[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    q, k = rope(q) * d ** -0.5, np.repeat(rope(k), H // KV, axis=2)
    logits = np.einsum("bihd,bjhd->bhij", q, k)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    visible = (j <= i) & (i - j < (cfg.sliding_window if kind == "sliding" else L))
    logits = np.where(visible, logits, -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """Float64 ``H`` of layer ``layer``'s mixer (``variant="full"``): ``(B, D, L, L)`` on conv
    layers, ``(B, heads, L, L)`` on attention layers."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    kind = cfg.layer_types[layer]
    return conv_operator(p, x, cfg) if kind == "conv" else attention_operator(p, x, cfg, kind)


__all__ = ["conv_operator", "rms", "frequencies", "attention_operator", "naive_operator"]
