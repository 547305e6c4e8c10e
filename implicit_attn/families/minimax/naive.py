"""Float64 references of MiniMax's mixers, written from the formulas with numpy (nothing shared
with ``block``): the lightning attention's ``H`` with its decayed ``q k^T`` per head, the norm and
gate as left diagonals and the values' SiLU as a right one, and the softmax attention's
probabilities (``griffin.naive``'s, with the window)."""
from __future__ import annotations

import numpy as np

from ..griffin.naive import attention_operator
from ..mamba.naive import sigmoid


def slopes(cfg, layer: int):
    """HF's decay rate of each head of layer ``layer``: ``b^(h+1) (1 - layer / (n - 1 + 1e-5) + 1e-5)``,
    ``b = 2^(-8 / H)``, ``n`` layers (float64)."""
    H, n = cfg.num_attention_heads, cfg.num_hidden_layers
    return 2.0 ** (-8.0 / H * np.arange(1, H + 1)) * (1.0 - layer / (n - 1 + 1e-5) + 1e-5)


def lightning_operator(p: dict, x, cfg, layer: int):
    """``H (B, C, L, L)`` of layer ``layer``'s lightning attention (``variant="full"``) for input ``x (B, L, D)``:
    ``H_c[i, j] = w_c sigmoid(g_c[i]) / rms(o[i]) (q_i . k_j) exp(-s_h (i - j)) sigmoid(v'_c[j])``
    for ``j <= i`` (``o`` the decayed linear attention's output over all ``C`` channels)."""
    B, L, _ = x.shape
    H, d = cfg.num_attention_heads, cfg.head_dim
    pre = (x @ p["qkv_proj.weight"].T).reshape(B, L, H, 3 * d)
    act = pre * sigmoid(pre)
    q, k, v = (act[..., n * d:(n + 1) * d].transpose(0, 2, 1, 3) for n in range(3))  # (B, H, L, d)
    s = slopes(cfg, layer)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    decay = np.where(j <= i, np.exp(-s[:, None, None] * np.maximum(i - j, 0)), 0.0)  # (H, L, L)
    K = np.einsum("bhid,bhjd->bhij", q, k) * decay[None]
    o = np.einsum("bhij,bhjd->bihd", K, v).reshape(B, L, H * d)
    inv = 1.0 / np.sqrt((o * o).mean(-1) + 1e-6)  # (B, L)
    gate = sigmoid(x @ p["output_gate.weight"].T)  # (B, L, C)
    left = (p["norm.weight"][None, None] * gate * inv[..., None]).transpose(0, 2, 1)  # (B, C, L)
    right = sigmoid(pre[..., 2 * d:].reshape(B, L, H * d)).transpose(0, 2, 1)
    return left[..., :, None] * np.repeat(K, d, axis=1) * right[..., None, :]


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """Float64 ``H`` of layer ``layer``'s mixer (``variant="full"``): ``(B, C, L, L)`` on lightning
    layers, ``(B, heads, L, L)`` on softmax attention layers."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    return lightning_operator(p, x, cfg, layer) if cfg.layer_types[layer] == "lightning" else attention_operator(p, x, cfg)


__all__ = ["slopes", "lightning_operator", "naive_operator"]
