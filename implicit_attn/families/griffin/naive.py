"""Float64 references of the RecurrentGemma temporal blocks' operators, written from the
formulas with numpy (no JAX, nothing shared with ``block``): for tests. One document."""
from __future__ import annotations

import math

import numpy as np

from ..mamba.naive import conv_matrices, sigmoid, softplus


def gelu_tanh(v):
    return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


def recurrent_operator(p: dict, x, cfg):
    """``diag(y) A M`` with ``A[i, j] = prod_{k=j+1..i} a_k * mult_j * i_j``: ``(B, C, L, L)``."""
    Bn, L, _ = x.shape
    C, Hh = cfg.lru_width, cfg.num_attention_heads
    y = gelu_tanh(x @ p["linear_y.weight"].T + p["linear_y.bias"])
    xs = x @ p["linear_x.weight"].T + p["linear_x.bias"]
    M = conv_matrices(p["conv_1d.weight"][:, 0, :])(L)
    xc = np.einsum("cij,bjc->bic", M, xs) + p["conv_1d.bias"]
    xh = xc.reshape(Bn, L, Hh, C // Hh)
    gate = lambda w, b: sigmoid(np.einsum("blhi,hij->blhj", xh, w) + b).reshape(Bn, L, C)
    gi = gate(p["rg_lru.input_gate_weight"], p["rg_lru.input_gate_bias"])
    gr = gate(p["rg_lru.recurrent_gate_weight"], p["rg_lru.recurrent_gate_bias"])
    a = np.exp(-8.0 * gr * softplus(p["rg_lru.recurrent_param"]))
    mult = np.sqrt(1.0 - a ** 2)
    a[:, 0], mult[:, 0] = 0.0, 1.0  # the sequence starts a document
    A = np.zeros((Bn, C, L, L))
    for j in range(L):
        acc = mult[:, j] * gi[:, j]
        for i in range(j, L):
            if i > j:
                acc = acc * a[:, i]
            A[:, :, i, j] = acc
    return np.einsum("bci,bcij,cjk->bcik", y.transpose(0, 2, 1), A, M)


def attention_operator(p: dict, x, cfg):
    """Softmax probabilities ``(B, heads, L, L)`` of the local multi-query attention."""
    Bn, L, _ = x.shape
    H, KV, d, R = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
    proj = lambda n, k: (x @ p[f"{n}_proj.weight"].T + p.get(f"{n}_proj.bias", 0.0)).reshape(Bn, L, k, d)
    q, k = proj("q", H), proj("k", KV)
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, R, 2) / R) if R else np.zeros(0)
    ang = np.arange(L)[:, None] * inv[None]  # (L, R/2)
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]

    def rope(t):
        if R == 0:
            return t
        a, b = t[..., :R // 2], t[..., R // 2:R]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin, t[..., R:]], axis=-1)

    q, k = rope(q) * cfg.attention_scale, np.repeat(rope(k), H // KV, axis=2)
    logits = np.einsum("bihd,bjhd->bhij", q, k)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    logits = np.where((j <= i) & (i - j < cfg.attention_window_size), logits, -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """Float64 ``H`` of layer ``layer``'s temporal block (``variant="full"``) for its
    params ``p`` and input ``x (B, L, d_model)``."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    if cfg.layer_types[layer] == "recurrent":
        return recurrent_operator(p, x, cfg)
    return attention_operator(p, x, cfg)


__all__ = ["naive_operator", "recurrent_operator", "attention_operator", "gelu_tanh"]
