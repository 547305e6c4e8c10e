"""Float64 references of Kimi-Linear's mixers, written from the formulas with numpy: the KDA's
``H`` from a step-by-step recurrence of the state with per-dimension decays
(``qwen3_next.naive.delta_matrix``) and the MLA attention's softmax probabilities."""
from __future__ import annotations

import numpy as np

from ..mamba.naive import conv_matrices, sigmoid
from ..qwen3_next.naive import delta_matrix


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def unit(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def chain(x, p, names):
    for n in names:
        x = x @ p[n].T
    return x


def kda_operator(p: dict, x, cfg):
    """``H (B, C, L, L)`` of Kimi Delta Attention (``variant="full"``) for input ``x (B, L, D)``."""
    B, L, _ = x.shape
    H, d = cfg.linear_num_heads, cfg.linear_head_dim
    C = H * d
    xs = np.concatenate([x @ p[f"{n}_proj.weight"].T for n in "qkv"], axis=-1)
    conv = conv_matrices(np.concatenate([p[f"{n}_conv1d.weight"] for n in "qkv"])[:, 0, :])(L)  # (3C, L, L)
    xc = np.einsum("cij,bjc->bic", conv, xs)
    u = xc * sigmoid(xc)
    heads = lambda t: t.reshape(B, L, H, d).transpose(0, 2, 1, 3)  # (B, L, C) -> (B, H, L, d)
    q, k = unit(heads(u[..., :C])) * d ** -0.5, unit(heads(u[..., C:2 * C]))
    g = chain(x, p, cfg.forget_projections) + p["dt_bias"]
    rate = np.exp(np.repeat(p["A_log"].reshape(H), d))
    if cfg.gate_lower_bound is None:
        log_a = heads(-rate * np.log1p(np.exp(g)))  # (B, H, L, d)
    else:
        log_a = heads(cfg.gate_lower_bound * sigmoid(rate * g))
    beta = sigmoid(x @ p["b_proj.weight"].T).transpose(0, 2, 1)
    M = delta_matrix(q, k, log_a, beta)  # (B, H, L, L)
    v = heads(u[..., 2 * C:])
    o = np.einsum("bhij,bhjd->bhid", M, v)
    inv = 1.0 / np.sqrt((o * o).mean(-1) + cfg.rms_norm_eps)  # (B, H, L)
    gate = sigmoid(chain(x, p, cfg.gate_projections)).transpose(0, 2, 1)  # (B, C, L)
    left = np.repeat(inv, d, axis=1) * p["o_norm.weight"][np.tile(np.arange(d), H)][None, :, None] * gate
    right = sigmoid(xc[..., 2 * C:]).transpose(0, 2, 1)
    Hm = left[..., :, None] * np.repeat(M, d, axis=1) * right[..., None, :]
    return np.einsum("bcij,cjk->bcik", Hm, conv[2 * C:])


def mla_operator(p: dict, x, cfg):
    """Softmax probabilities ``(B, heads, L, L)`` of the MLA attention (no positional encoding)."""
    B, L, _ = x.shape
    H, dn, dr = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if cfg.q_lora_rank is None:
        q = x @ p["q_proj.weight"].T
    else:
        q = rms(x @ p["q_a_proj.weight"].T + p.get("q_a_proj.bias", 0.0), p["q_a_layernorm.weight"], 1e-6) \
            @ p["q_b_proj.weight"].T
    c = x @ p["kv_a_proj_with_mqa.weight"].T + p.get("kv_a_proj_with_mqa.bias", 0.0)
    kv = (rms(c[..., :cfg.kv_lora_rank], p["kv_a_layernorm.weight"], 1e-6) @ p["kv_b_proj.weight"].T)
    k_nope = kv.reshape(B, L, H, -1)[..., :dn]
    k_shared, q = c[:, :, None, cfg.kv_lora_rank:], q.reshape(B, L, H, dn + dr)
    if cfg.mla_rope_theta is not None:  # pairs (x_0, x_1), (x_2, x_3), ... rotated by theta^(-2i/R)
        ang = np.arange(L)[:, None] * cfg.mla_rope_theta ** (-np.arange(0, dr, 2) / dr)
        cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        rot = lambda t: np.concatenate([t[..., 0::2] * cos - t[..., 1::2] * sin,
                                        t[..., 1::2] * cos + t[..., 0::2] * sin], axis=-1)
        q, k_shared = np.concatenate([q[..., :dn], rot(q[..., dn:])], axis=-1), rot(k_shared)
    k = np.concatenate([k_nope, np.broadcast_to(k_shared, (B, L, H, dr))], axis=-1)
    logits = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(dn + dr)
    logits = np.where(np.tril(np.ones((L, L), bool)), logits, -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """Float64 ``H`` of layer ``layer``'s mixer (``variant="full"``): ``(B, C, L, L)`` on KDA
    layers, ``(B, heads, L, L)`` on attention layers."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    return kda_operator(p, x, cfg) if cfg.layer_types[layer] == "delta" else mla_operator(p, x, cfg)


__all__ = ["kda_operator", "mla_operator", "naive_operator"]
