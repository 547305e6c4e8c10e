"""Float64 reference of the Mamba-2 mixer's operator, written from the formulas with numpy
(no JAX, nothing shared with ``block``): for tests."""
from __future__ import annotations

import numpy as np

from ..mamba.naive import conv_matrices, sigmoid, softplus


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """``H (B, C, L, L)`` float64 of ``variant="full"`` for mixer params ``p`` and mixer input
    ``x (B, L, d_model)``: ``diag(g SiLU z) alpha_h diag(sigmoid xpre) M`` with the gated
    norm's per-token scale ``g = w / rms_group(y SiLU z)`` (``cfg.norm_mode``: or ``w /
    rms_group(y)``, or 1), ``in_proj`` applied to ``x * cfg.in_multiplier`` and its rows
    scaled by ``cfg.proj_multipliers``, and
    ``alpha_h[i, j] = (C_i . B_j) exp(A_h sum_{t=j+1..i} dt_h[t]) dt_h[j] + D_h [i = j]``."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    Bn, L, _ = x.shape
    C, H, P, G, N = cfg.d_ssm, cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.state_size
    m = cfg.d_mlp
    proj = (x * cfg.in_multiplier) @ p["in_proj.weight"].T + p.get("in_proj.bias", 0.0)
    if cfg.proj_multipliers is not None:  # (z, x, B, C, dt) rows after the [z0, x0] part
        sizes = (C, C, G * N, G * N, H)
        proj = proj * np.concatenate([np.ones(2 * m)] + [np.full(n, v) for n, v in zip(sizes, cfg.proj_multipliers)])
    z = proj[..., 2 * m:2 * m + C]
    xbc = proj[..., 2 * m + C:2 * m + C + cfg.conv_dim]
    dt_in = proj[..., 2 * m + C + cfg.conv_dim:]
    M = conv_matrices(p["conv1d.weight"][:, 0, :])(L)
    xpre = np.einsum("cij,bjc->bic", M, xbc) + p.get("conv1d.bias", 0.0)
    act = xpre * sigmoid(xpre)
    u = act[..., :C]
    Bm = act[..., C:C + G * N].reshape(Bn, L, G, N)
    Cm = act[..., C + G * N:].reshape(Bn, L, G, N)
    dt = np.clip(softplus(dt_in + p["dt_bias"]), *cfg.time_step_limit)  # (B, L, H)
    A = -np.exp(p["A_log"])
    S = np.cumsum(dt, axis=1)
    g_of = np.arange(H) // (H // G)
    alpha = np.zeros((Bn, H, L, L))
    for i in range(L):
        for j in range(i + 1):
            cb = np.einsum("bgn,bgn->bg", Cm[:, i], Bm[:, j])[:, g_of]  # (B, H)
            alpha[:, :, i, j] = cb * np.exp(A * (S[:, i] - S[:, j])) * dt[:, j]
        alpha[:, :, i, i] += p["D"]
    head = np.arange(C) // P
    y = np.einsum("bcij,bjc->bic", alpha[:, head], u)
    gs = y * (z * sigmoid(z))
    if cfg.norm_mode == "none":
        scale = np.ones_like(y)
    else:  # the rms of the gated output, or of y before the gate (Falcon-H1)
        src = gs if cfg.norm_mode == "gate_then_norm" else y
        rms = np.sqrt(np.mean(src.reshape(Bn, L, G, C // G) ** 2, axis=-1) + cfg.layer_norm_epsilon)
        scale = p["norm.weight"] / np.repeat(rms, C // G, axis=-1)  # (B, L, C)
    left = (scale * z * sigmoid(z)).transpose(0, 2, 1)
    right = sigmoid(xpre[..., :C]).transpose(0, 2, 1)
    Hm = left[..., None] * alpha[:, head] * right[:, :, None, :]
    return np.einsum("bcij,cjk->bcik", Hm, M[:C])


__all__ = ["naive_operator"]
