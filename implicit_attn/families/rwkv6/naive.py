"""Float64 references of the RWKV-6 time mix's operator, written from the formulas with numpy (no
JAX, nothing shared with ``block``): for tests. RWKV-7's reuses ``dplr_head_matrix``."""
from __future__ import annotations

import numpy as np

from ..mamba.naive import sigmoid


def layer_shift(x):
    """``x_{t-1} - x_t`` (``x_{-1} = 0``) of ``x (B, L, C)``."""
    return np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1) - x


def dplr_head_matrix(r, k, log_w, a=None, b=None, bonus=None, after=True):
    """``M (B, H, L, L)`` of ``S_t = S_{t-1} (Diag(w_t) + a_t b_t^T) + v_t k_t^T`` read as ``S_t r_t``
    (``after``) or ``S_{t-1} r_t + bonus_t v_t``: the weight of ``v_j`` in ``o_i``, by carrying
    ``k_j^T`` through every later transition. Inputs ``(B, H, L, K)``, ``bonus (B, H, L)``."""
    B, H, L, K = k.shape
    w = np.exp(log_w)
    M = np.zeros((B, H, L, L))
    for bb in range(B):
        for h in range(H):
            for j in range(L):
                row = k[bb, h, j].copy()
                for i in range(j, L):
                    if i > j or not after:
                        if i > j:
                            if not after:
                                M[bb, h, i, j] = row @ r[bb, h, i]
                            step = np.diag(w[bb, h, i])
                            if a is not None:
                                step = step + np.outer(a[bb, h, i], b[bb, h, i])
                            row = row @ step
                    if after:
                        M[bb, h, i, j] = row @ r[bb, h, i]
                if not after and bonus is not None:
                    M[bb, h, j, j] = bonus[bb, h, j]
    return M


def group_scale(M, v, weight, eps):
    """``diag(w_c / sigma_h) M_h`` per channel: ``(B, H V, L, L)``, ``sigma_h`` the standard
    deviation over the head's channels of ``o = M v`` (``v (B, H, L, V)``)."""
    o = np.einsum("bhij,bhjv->bhiv", M, v)
    sigma = np.sqrt(o.var(-1) + eps)  # (B, H, L)
    B, H, L, V = v.shape
    left = (weight.reshape(H, V)[None, :, None, :] / sigma[..., None])  # (B, H, L, V)
    Hc = left.transpose(0, 1, 3, 2)[..., None] * M[:, :, None]  # (B, H, V, L, L)
    return Hc.reshape(B, H * V, L, L)


def naive_parts(p: dict, x, cfg) -> dict:
    """Float64 factors of the RWKV-6 time mix for its input ``x (B, L, C)``: ``r, k, log_w (B, H, L,
    K)``, ``v (B, H, L, V)``, ``bonus (B, H, L)``, ``gate (B, L, V)`` (``silu(g)``)."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    B, L, C = x.shape
    H, R = cfg.num_heads, cfg.proj_low_rank_dim
    d = layer_shift(x)
    z = np.tanh((x + d * p["x_proj.0.mu"]) @ p["x_proj.0.linear.weight"].T)
    W2 = p["x_proj.2.weight"]  # (C, 5R): group n reads columns n R ... (n + 1) R - 1
    m = {n: z[..., i * R:(i + 1) * R] @ W2[:, i * R:(i + 1) * R].T + p["x_bias"][i]
         for i, n in enumerate("rwkvg")}
    xin = {n: x + d * m[n] for n in m}
    hd = lambda t: t.reshape(B, L, H, -1).transpose(0, 2, 1, 3)
    r = hd(xin["r"] @ p["r_proj.linear.weight"].T)
    k = hd(xin["k"] @ p["k_proj.linear.weight"].T)
    v = hd(xin["v"] @ p["v_proj.linear.weight"].T)
    g = xin["g"] @ p["g_proj.linear.weight"].T
    raw = np.tanh(xin["w"] @ p["w_proj.linear.lora.0.weight"].T) @ p["w_proj.linear.lora.2.weight"].T \
        + p["w_proj.linear.lora.2.bias"]
    log_w = hd(-np.exp(raw))
    bonus = np.einsum("bhlk,hk,bhlk->bhl", r, p["bonus"], k)
    return dict(r=r, k=k, v=v, log_w=log_w, bonus=bonus, gate=g * sigmoid(g))


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """``H (B, V, L, L)`` float64 of ``variant="full"`` for time-mix params ``p`` and its input ``x
    (B, L, C)``: ``diag(silu(g) w / sigma_h) M_h`` (on the head-centred values)."""
    f = naive_parts(p, x, cfg)
    M = dplr_head_matrix(f["r"], f["k"], f["log_w"], bonus=f["bonus"], after=False)
    Hc = group_scale(M, f["v"], np.asarray(p["g_norm.weight"], np.float64), cfg.group_norm_eps)
    return f["gate"].transpose(0, 2, 1)[..., None] * Hc


__all__ = ["layer_shift", "dplr_head_matrix", "group_scale", "naive_parts", "naive_operator"]
