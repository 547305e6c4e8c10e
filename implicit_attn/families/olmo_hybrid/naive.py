"""Float64 references of OLMo-Hybrid's mixers, with numpy: the Gated DeltaNet's ``H`` from
``qwen3_next.naive`` (a step-by-step recurrence of the state; it reads the projection names, the
write-strength scale and the norm eps from the config), and the attention's softmax
probabilities with q and k RMS-normed over all heads together."""
from __future__ import annotations

import numpy as np

from ..qwen3_next.naive import causal_softmax, delta_operator


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def attention_operator(p: dict, x, cfg):
    """Softmax probabilities ``(B, heads, L, L)`` of the attention layer."""
    B, L, _ = x.shape
    H, KV, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = rms(x @ p["q_proj.weight"].T + p.get("q_proj.bias", 0.0), p["q_norm.weight"], cfg.rms_norm_eps)
    k = rms(x @ p["k_proj.weight"].T + p.get("k_proj.bias", 0.0), p["k_norm.weight"], cfg.rms_norm_eps)
    return causal_softmax(q.reshape(B, L, H, d), k.reshape(B, L, KV, d), cfg)


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """Float64 ``H`` of layer ``layer``'s mixer (``variant="full"``): ``(B, C, L, L)`` on Gated
    DeltaNet layers, ``(B, heads, L, L)`` on attention layers."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    return delta_operator(p, x, cfg) if cfg.layer_types[layer] == "delta" else attention_operator(p, x, cfg)


__all__ = ["attention_operator", "naive_operator"]
