"""Float64 reference of the RWKV-7 time mix's operator, written from the formulas with numpy (no
JAX, nothing shared with ``block``): for tests."""
from __future__ import annotations

import numpy as np

from ..mamba.naive import sigmoid
from ..rwkv6.naive import dplr_head_matrix, group_scale, layer_shift


def naive_parts(p: dict, x_ext, cfg, layer: int = 0) -> dict:
    """Float64 factors of layer ``layer``'s RWKV-7 time mix for its input ``[x, v_first] (B, L, C +
    V)``: ``r, k, log_w, kk, a (B, H, L, K)`` (``k`` after its update), ``v (B, H, L, V)`` (after the
    value residual), ``beta (B, H, L)`` (``sum_k r k r_k``), ``gate (B, L, V)``."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x_ext = np.asarray(x_ext, np.float64)
    C, H = cfg.hidden_size, cfg.num_heads
    x, v_first = x_ext[..., :C], x_ext[..., C:]
    B, L, _ = x.shape
    d = layer_shift(x)
    xin = {n: x + d * p["x_" + n].reshape(-1) for n in "rwkvag"}
    lo = lambda t, name, act=lambda z: z, bias=True: \
        act(t @ p[f"{name}.lora.0.weight"].T) @ p[f"{name}.lora.2.weight"].T + (p[f"{name}.lora.2.bias"] if bias else 0)
    r = xin["r"] @ p["r_proj.weight"].T
    k = xin["k"] @ p["k_proj.weight"].T
    v = xin["v"] @ p["v_proj.weight"].T
    if layer > 0:
        v = v + (v_first - v) * sigmoid(lo(xin["v"], "v_lora"))
    log_w = -np.exp(-0.5) * sigmoid(lo(xin["w"], "w_lora", np.tanh))
    a = sigmoid(lo(xin["a"], "a_lora"))
    g = lo(xin["g"], "g_lora", sigmoid, bias=False)
    hd = lambda t: t.reshape(B, L, H, -1).transpose(0, 2, 1, 3)
    kk = hd(k * p["k_k"])
    n2 = (kk * kk).sum(-1, keepdims=True)
    kk = kk / (np.sqrt(n2 + 1e-6) if cfg.fuse_norm else np.maximum(np.sqrt(n2), 1e-12))
    k = k * (1 + (a - 1) * p["k_a"])
    rh, kh = hd(r), hd(k)
    beta = np.einsum("bhlk,hk->bhl", rh * kh, p["r_k"])
    return dict(r=rh, k=kh, v=hd(v), log_w=hd(log_w), kk=kk, a=hd(a), beta=beta, gate=g)


def naive_operator(p: dict, x_ext, cfg, layer: int = 0):
    """``H (B, V, L, L)`` float64 of ``variant="full"`` for time-mix params ``p`` and its input
    ``x_ext = [x, v_first] (B, L, C + V)``: ``diag(g w / sigma_h) M_h + diag(g beta_h)`` (on the
    head-centred values), ``M_h`` from the DPLR recurrence carried step by step."""
    f = naive_parts(p, x_ext, cfg, layer)
    M = dplr_head_matrix(f["r"], f["k"], f["log_w"], -f["kk"], f["kk"] * f["a"], after=True)
    Hc = group_scale(M, f["v"], np.asarray(p["g_norm.weight"], np.float64), cfg.group_norm_eps)
    V, L = f["v"].shape[-1], M.shape[-1]
    diag = np.repeat(f["beta"], V, axis=1)  # (B, H V, L)
    Hc = Hc + diag[..., None] * np.eye(L)[None, None]
    return f["gate"].transpose(0, 2, 1)[..., None] * Hc


__all__ = ["naive_parts", "naive_operator"]
