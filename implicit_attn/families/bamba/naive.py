"""Float64 references of Bamba's mixers (for tests): the Mamba-2 formula of
``mamba2.naive`` and the softmax attention formula of ``griffin.naive`` (full window)."""
from __future__ import annotations

import numpy as np

from ..griffin.naive import attention_operator
from ..mamba2.naive import naive_operator as mamba_operator


def hybrid_naive_operator(p: dict, x, cfg, layer: int, mamba_operator):
    """Float64 ``H`` of layer ``layer``'s mixer (``variant="full"``) for its params ``p`` and
    input ``x (B, L, d_model)``: ``mamba_operator(p, x, cfg.mixer_config)`` ``(B, C, L, L)`` on
    Mamba layers, the softmax attention ``(B, heads, L, L)`` on attention layers."""
    if cfg.layer_types[layer] == "mamba":
        return mamba_operator(p, x, cfg.mixer_config)
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    return attention_operator(p, np.asarray(x, np.float64), cfg)


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """``hybrid_naive_operator`` with the Mamba-2 formula: ``(B, C, L, L)`` or ``(B, heads, L, L)``."""
    return hybrid_naive_operator(p, x, cfg, layer, mamba_operator)


__all__ = ["hybrid_naive_operator", "naive_operator"]
