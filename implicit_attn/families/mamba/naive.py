"""Float64 reference of the Mamba mixer's operator, written from the formulas with numpy
(no JAX, nothing shared with ``block``): for tests."""
from __future__ import annotations

import numpy as np


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def softplus(v):
    return np.logaddexp(0.0, v)


def conv_matrices(w) -> callable:
    """``L -> (C, L, L)`` banded causal conv matrices of filters ``w (C, K)``."""
    def build(L: int):
        C, K = w.shape
        M = np.zeros((C, L, L))
        for d in range(K):
            for i in range(d, L):
                M[:, i, i - d] = w[:, K - 1 - d]
        return M
    return build


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """``H (B, C, L, L)`` float64 of ``variant="full"`` for mixer params ``p`` and mixer input
    ``x (B, L, d_model)``: ``diag(SiLU z) alpha diag(sigmoid xc) M`` with
    ``alpha[i, j] = sum_n C[i, n] exp(A[c, n] sum_{t=j+1..i} dt[t]) dt[j] B[j, n] + D [i = j]``."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    Bn, L, _ = x.shape
    C, N, R = cfg.intermediate_size, cfg.state_size, cfg.time_step_rank
    proj = x @ p["in_proj.weight"].T + p.get("in_proj.bias", 0.0)
    xs, z = proj[..., :C], proj[..., C:]
    M = conv_matrices(p["conv1d.weight"][:, 0, :])(L)
    xc = np.einsum("cij,bjc->bic", M, xs) + p.get("conv1d.bias", 0.0)
    u = xc * sigmoid(xc)
    xdbl = u @ p["x_proj.weight"].T
    dt_in, Bm, Cm = xdbl[..., :R], xdbl[..., R:R + N], xdbl[..., R + N:]
    if cfg.bcdt_norm_eps is not None:  # Falcon-Mamba, Jamba: RMSNorm on dt, B, C (Jamba's weighted)
        names = ("dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight")
        dt_in, Bm, Cm = (p.get(n, 1.0) * v / np.sqrt(np.mean(v * v, -1, keepdims=True) + cfg.bcdt_norm_eps)
                         for v, n in zip((dt_in, Bm, Cm), names))
    dt = softplus(dt_in @ p["dt_proj.weight"].T + p["dt_proj.bias"])  # (B, L, C)
    A = -np.exp(p["A_log"])  # (C, N)
    S = np.cumsum(dt, axis=1)
    alpha = np.zeros((Bn, C, L, L))
    for i in range(L):
        for j in range(i + 1):
            T = S[:, i] - S[:, j]  # (B, C): sum of dt over j+1..i
            dec = np.exp(A[None] * T[..., None])  # (B, C, N)
            alpha[:, :, i, j] = np.einsum("bn,bcn,bn->bc", Cm[:, i], dec, Bm[:, j]) * dt[:, j]
        alpha[:, :, i, i] += p["D"]
    gate = z * sigmoid(z)
    H = gate.transpose(0, 2, 1)[..., None] * alpha * sigmoid(xc).transpose(0, 2, 1)[:, :, None, :]
    return np.einsum("bcij,cjk->bcik", H, M)


__all__ = ["naive_operator", "conv_matrices", "sigmoid", "softplus"]
