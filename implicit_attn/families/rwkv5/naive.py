"""Float64 reference of the RWKV-5 time mix's operator, written from the formulas with numpy
(no JAX, nothing shared with ``block``; RWKV-6's ``dplr_head_matrix`` / ``group_scale``): for tests."""
from __future__ import annotations

import numpy as np

from ..mamba.naive import sigmoid
from ..rwkv6.naive import dplr_head_matrix, group_scale


def naive_parts(p: dict, x, cfg) -> dict:
    """Float64 factors of the RWKV-5 time mix for its input ``x (B, L, C)``: ``r, k, log_w (B,
    H, L, S)``, ``v (B, H, L, S)``, ``bonus (B, H, L)`` (``sum_k r u k``), ``gate (B, L, C)``
    (``silu(g)``)."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    B, L, C = x.shape
    H = cfg.num_heads
    prev = np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
    proj = lambda name: (x * p["time_mix_" + name] + prev * (1 - p["time_mix_" + name])) @ p[name + ".weight"].T
    hd = lambda t: t.reshape(B, L, H, -1).transpose(0, 2, 1, 3)
    r, k, v, g = hd(proj("receptance")), hd(proj("key")), hd(proj("value")), proj("gate")
    log_w = np.broadcast_to(-np.exp(p["time_decay"])[None, :, None, :], r.shape)
    bonus = np.einsum("bhlk,hk,bhlk->bhl", r, p["time_faaaa"], k)
    return dict(r=r, k=k, v=v, log_w=log_w, bonus=bonus, gate=g * sigmoid(g))


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """``H (B, C, L, L)`` float64 of ``variant="full"`` for time-mix params ``p`` and its input
    ``x (B, L, C)``: ``diag(silu(g) w / sigma_h) M_h`` (on the head-centred values), ``sigma_h``
    with the group norm's eps on ``o`` (``1e-5 head_size_divisor^2``)."""
    f = naive_parts(p, x, cfg)
    M = dplr_head_matrix(f["r"], f["k"], f["log_w"], bonus=f["bonus"], after=False)
    Hc = group_scale(M, f["v"], np.asarray(p["ln_x.weight"], np.float64), cfg.group_norm_eps)
    return f["gate"].transpose(0, 2, 1)[..., None] * Hc


__all__ = ["naive_parts", "naive_operator"]
