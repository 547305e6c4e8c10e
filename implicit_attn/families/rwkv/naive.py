"""Float64 reference of the RWKV-4 time mix's operator, written from the formulas with
numpy (no JAX, nothing shared with ``block``): for tests."""
from __future__ import annotations

import numpy as np

from ..mamba.naive import sigmoid


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """``H (B, A, L, L)`` float64 of ``variant="full"`` for time-mix params ``p`` and its input
    ``x (B, L, D)`` (the ``ln1`` output): ``diag(sigmoid r) softmax_rows(l)`` with
    ``l[i, j] = (i-1-j) w + k_j`` for ``j < i`` and ``u + k_i`` on the diagonal."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    Bn, L, _ = x.shape
    prev = np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
    mixed = lambda mu: x * mu + prev * (1 - mu)
    k = mixed(p["time_mix_key"]) @ p["key.weight"].T
    r = mixed(p["time_mix_receptance"]) @ p["receptance.weight"].T
    w, u = -np.exp(p["time_decay"]), p["time_first"]
    A = k.shape[-1]
    H = np.zeros((Bn, A, L, L))
    for i in range(L):
        l = np.full((Bn, A, i + 1), 0.0)
        for j in range(i):
            l[:, :, j] = (i - 1 - j) * w + k[:, j]
        l[:, :, i] = u + k[:, i]
        e = np.exp(l - l.max(-1, keepdims=True))
        H[:, :, i, :i + 1] = e / e.sum(-1, keepdims=True)
    return sigmoid(r).transpose(0, 2, 1)[..., None] * H


__all__ = ["naive_operator"]
