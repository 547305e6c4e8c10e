"""Float64 references of Qwen3-Next's mixers, written from the formulas with numpy (nothing
shared with ``block``): the Gated DeltaNet's ``H`` from a step-by-step recurrence of the state
with the identity as values, and the gated attention's softmax probabilities."""
from __future__ import annotations

import numpy as np

from ..mamba.naive import conv_matrices, sigmoid, softplus


def unit(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def zc_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def delta_matrix(q, k, log_a, beta):
    """``M (B, H, L, L)``: row ``t`` is ``S_t q_t`` for the values ``v_j = e_j``; ``log_a (B, H, L)``
    or ``(B, H, L, d_k)`` (the state decays, then the erasure, then the write)."""
    B, H, L, dk = k.shape
    M = np.zeros((B, H, L, L))
    for b in range(B):
        for h in range(H):
            S = np.zeros((L, dk))
            for t in range(L):
                kt = k[b, h, t]
                S = S * np.exp(log_a[b, h, t])  # a scalar, or one factor per key dimension (KDA)
                S = S - beta[b, h, t] * np.outer(S @ kt, kt)
                S[t] += beta[b, h, t] * kt
                M[b, h, t] = S @ q[b, h, t]
    return M


def delta_operator(p: dict, x, cfg):
    """``H (B, C, L, L)`` of the Gated DeltaNet (``variant="full"``) for input ``x (B, L, D)``."""
    B, L, _ = x.shape
    Hk, Hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    rep = Hv // Hk
    if "in_proj_qkv.weight" in p:  # Qwen3.5's four plain projections
        xs = x @ p["in_proj_qkv.weight"].T
        z, b, a = (x @ p[f"in_proj_{n}.weight"].T for n in "zba")
    elif "in_proj.weight" in p:  # LaraMini's one, rows [q | k | v | z | b | a]
        rows = np.cumsum([2 * Hk * dk + Hv * dv, Hv * dv, Hv])
        xs, z, b, a = np.split(x @ p["in_proj.weight"].T, rows, axis=-1)
    elif "g_proj.weight" in p:  # OLMo-Hybrid's six
        xs = np.concatenate([x @ p[f"{n}_proj.weight"].T for n in "qkv"], axis=-1)
        z, b, a = (x @ p[f"{n}_proj.weight"].T for n in "gba")
    else:
        qkvz = (x @ p["in_proj_qkvz.weight"].T).reshape(B, L, Hk, 2 * dk + 2 * rep * dv)
        q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + rep * dv], axis=-1)
        b, a = np.split((x @ p["in_proj_ba.weight"].T).reshape(B, L, Hk, 2 * rep), 2, axis=-1)
        xs = np.concatenate([q.reshape(B, L, -1), k.reshape(B, L, -1), v.reshape(B, L, -1)], axis=-1)
    conv = conv_matrices(p["conv1d.weight"][:, 0, :])(L)  # (conv_dim, L, L)
    xc = np.einsum("cij,bjc->bic", conv, xs)
    u = xc * sigmoid(xc)
    qh = unit(u[..., :Hk * dk].reshape(B, L, Hk, dk)).transpose(0, 2, 1, 3) * dk ** -0.5
    kh = unit(u[..., Hk * dk:2 * Hk * dk].reshape(B, L, Hk, dk)).transpose(0, 2, 1, 3)
    vh = u[..., 2 * Hk * dk:].reshape(B, L, Hv, dv).transpose(0, 2, 1, 3)
    beta = cfg.beta_scale * sigmoid(b.reshape(B, L, Hv)).transpose(0, 2, 1)
    log_a = (-np.exp(p["A_log"]) * softplus(a.reshape(B, L, Hv) + p["dt_bias"])).transpose(0, 2, 1)
    M = delta_matrix(np.repeat(qh, rep, 1), np.repeat(kh, rep, 1), log_a, beta)  # (B, Hv, L, L)
    o = np.einsum("bhij,bhjd->bhid", M, vh)
    inv = 1.0 / np.sqrt((o * o).mean(-1) + cfg.delta_norm_eps)  # (B, Hv, L)
    zt = z.reshape(B, L, Hv * dv).transpose(0, 2, 1)  # (B, C, L)
    left = np.repeat(inv, dv, axis=1) * p[cfg.delta_norm_name][np.tile(np.arange(dv), Hv)][None, :, None] * zt * sigmoid(zt)
    right = sigmoid(xc[..., 2 * Hk * dk:]).transpose(0, 2, 1)
    H = left[..., :, None] * np.repeat(M, dv, axis=1) * right[..., None, :]
    return np.einsum("bcij,cjk->bcik", H, conv[2 * Hk * dk:])


def causal_softmax(q, k, cfg):
    """Softmax probabilities ``(B, heads, L, L)`` of queries ``(B, L, H, d)`` and keys ``(B, L, KV, d)``
    (normed as the model does), after RoPE on the first ``cfg.rotary_dim`` features (none if 0)
    and the ``d^-1/2`` scale."""
    B, L, H, d = q.shape
    R = cfg.rotary_dim

    def rope(t):
        if R == 0:
            return t
        ang = np.arange(L)[:, None] * (1.0 / cfg.rope_theta ** (np.arange(0, R, 2) / R))[None]
        cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        a, b = t[..., :R // 2], t[..., R // 2:R]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin, t[..., R:]], axis=-1)

    q, k = rope(q) * d ** -0.5, np.repeat(rope(k), H // k.shape[2], axis=2)
    logits = np.einsum("bihd,bjhd->bhij", q, k)
    logits = np.where(np.tril(np.ones((L, L), bool)), logits, -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def attention_operator(p: dict, x, cfg):
    """Softmax probabilities ``(B, heads, L, L)`` of the gated attention (before its gate)."""
    B, L, _ = x.shape
    H, KV, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = (x @ p["q_proj.weight"].T + p.get("q_proj.bias", 0.0)).reshape(B, L, H, 2 * d)[..., :d]
    k = (x @ p["k_proj.weight"].T + p.get("k_proj.bias", 0.0)).reshape(B, L, KV, d)
    return causal_softmax(zc_norm(q, p["q_norm.weight"], cfg.rms_norm_eps),
                          zc_norm(k, p["k_norm.weight"], cfg.rms_norm_eps), cfg)


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """Float64 ``H`` of layer ``layer``'s mixer (``variant="full"``): ``(B, C, L, L)`` on Gated
    DeltaNet layers, ``(B, heads, L, L)`` on attention layers."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    return delta_operator(p, x, cfg) if cfg.layer_types[layer] == "delta" else attention_operator(p, x, cfg)


__all__ = ["delta_matrix", "delta_operator", "causal_softmax", "attention_operator", "naive_operator"]
