"""Float64 reference of the mLSTM layer's operator, written from the formulas with numpy (no JAX,
nothing shared with ``block``): for tests. The stabiliser follows the torch forward's schedule
position by position (chunk-wise rows take the larger of the carried state's weight and their
chunk's largest log weight; step-wise rows ``m_t = max(f_t + m_{t-1}, i_t)``)."""
from __future__ import annotations

import numpy as np

from ..mamba.naive import sigmoid


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def naive_stabiliser(log_f, log_i, chunk: int, segment: int):
    """``m (..., L)`` of the torch forward (zero initial state), in float64, by loops."""
    L = log_f.shape[-1]
    m = np.zeros(log_f.shape)
    carry = np.zeros(log_f.shape[:-1])
    pieces = [(s, min(s + segment, L)) for s in range(0, L, segment)] if L > segment else [(0, L)]
    for s, e in pieces:
        n = (e - s) // chunk * chunk
        for c in range(s, s + n, chunk):
            for t in range(c, c + chunk):
                # log weight of position j <= t of this chunk in row t, and of the carried state
                w = [log_f[..., j + 1:t + 1].sum(-1) + log_i[..., j] for j in range(c, t + 1)]
                m[..., t] = np.maximum(log_f[..., c:t + 1].sum(-1) + carry, np.max(w, axis=0))
            last = [log_f[..., j + 1:c + chunk].sum(-1) + log_i[..., j] for j in range(c, c + chunk)]
            carry = np.maximum(log_f[..., c:c + chunk].sum(-1) + carry, np.max(last, axis=0))
        for t in range(s + n, e):
            carry = np.maximum(log_f[..., t] + carry, log_i[..., t])
            m[..., t] = carry
    return m


def naive_head_matrix(q, k, log_f, log_i, m, eps: float | None = None, norm=None):
    """``M (B, H, L, L)``: ``D[i, j] = exp(sum_{t=j+1..i} f_t + i_j - m_i) (q_i . k_j)`` for ``j <= i``,
    each row divided by ``max(|sum_j D[i, j]|, exp(-m_i)) + eps``, or by ``norm (B, H, L)`` when given
    (a layer's own normaliser)."""
    if (eps is None) == (norm is None):
        raise ValueError("naive_head_matrix needs exactly one of eps and norm")
    L = q.shape[2]
    M = np.zeros(q.shape[:2] + (L, L))
    for i in range(L):
        for j in range(i + 1):
            M[..., i, j] = np.exp(log_f[..., j + 1:i + 1].sum(-1) + log_i[..., j] - m[..., i]) \
                * np.einsum("bhd,bhd->bh", q[:, :, i], k[:, :, j])
    if norm is None:
        norm = np.maximum(np.abs(M.sum(-1)), np.exp(-m)) + eps
    return M / norm[..., None]


def naive_parts(p: dict, x, cfg) -> dict:
    """Float64 factors of the mLSTM layer for its input ``x (B, L, D)``: ``q`` (scaled), ``k (B, H, L,
    d_k)``, ``v (B, H, L, d_v)``, ``log_f``, ``log_i``, ``m (B, H, L)``, ``gate (B, L, V)``."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    B, L, _ = x.shape
    H, QK, V = cfg.num_heads, cfg.qk_dim, cfg.v_dim
    lin = lambda n: x @ p[n + ".weight"].T + p.get(n + ".bias", 0.0)
    if cfg.weight_mode == "single":
        q, k, v, o = lin("q"), lin("k"), lin("v"), lin("ogate_preact")
        i, f = lin("igate_preact"), lin("fgate_preact")
    else:
        z = lin("qkv_opreact")
        q, k, v, o = np.split(z, [QK, 2 * QK, 2 * QK + V], axis=-1)
        i, f = np.split(lin("ifgate_preact"), [H], axis=-1)
    cap = cfg.gate_soft_cap
    i, f = cap * np.tanh(i / cap), cap * np.tanh(f / cap)
    hd = lambda t: t.reshape(B, L, H, -1).transpose(0, 2, 1, 3)
    log_i, log_f = i.transpose(0, 2, 1), log_sigmoid(f.transpose(0, 2, 1))
    m = naive_stabiliser(log_f, log_i, cfg.chunk_size, cfg.max_inference_chunksize)
    return dict(q=hd(q) / np.sqrt(cfg.qk_head_dim), k=hd(k), v=hd(v), log_f=log_f, log_i=log_i, m=m,
                gate=sigmoid(o))


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """``H (B, V, L, L)`` float64 of ``variant="full"`` for mLSTM params ``p`` and its input ``x (B, L,
    D)``: ``diag(sigmoid(o) w / sigma_h) M_h`` (on the head-centred values), ``sigma_h`` the standard
    deviation over the head's channels of ``M_h v`` plus ``norm_eps``."""
    f = naive_parts(p, x, cfg)
    M = naive_head_matrix(f["q"], f["k"], f["log_f"], f["log_i"], f["m"], cfg.eps)
    h = np.einsum("bhij,bhjv->bhiv", M, f["v"])
    sigma = np.sqrt(h.var(-1) + cfg.norm_eps)  # (B, H, L)
    B, H, L, dv = f["v"].shape
    w = np.asarray(p["multihead_norm.weight"], np.float64).reshape(H, dv)
    left = w[None, :, None, :] / sigma[..., None]  # (B, H, L, dv)
    Hc = (left.transpose(0, 1, 3, 2)[..., None] * M[:, :, None]).reshape(B, H * dv, L, L)
    return f["gate"].transpose(0, 2, 1)[..., None] * Hc


__all__ = ["log_sigmoid", "naive_stabiliser", "naive_head_matrix", "naive_parts", "naive_operator"]
