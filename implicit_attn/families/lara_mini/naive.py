"""Float64 references of LaraMini's mixers, with numpy: the Gated DeltaNet's ``H`` from
``qwen3_next.naive`` (a step-by-step recurrence of the state; it reads the one ``in_proj``), and
the attention's softmax probabilities from ``lfm2.naive`` (per-head q/k norms, causal within the
sliding window), with RoPE on the sliding layers only."""
from __future__ import annotations

import numpy as np

from ..lfm2.naive import attention_operator
from ..qwen3_next.naive import delta_operator


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """Float64 ``H`` of layer ``layer``'s mixer (``variant="full"``): ``(B, C, L, L)`` on Gated
    DeltaNet layers, ``(B, heads, L, L)`` on attention layers."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    kind = cfg.layer_types[layer]
    if kind == "delta":
        return delta_operator(p, x, cfg)
    d = cfg.head_dim
    inv = cfg.rope_theta ** (-np.arange(0, d, 2) / d) if kind == "sliding" else np.zeros(d // 2)
    return attention_operator(p, x, cfg, kind, inv)


__all__ = ["naive_operator"]
