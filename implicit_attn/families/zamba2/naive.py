"""Float64 references of Zamba2's mixers (for tests): the Mamba-2 formula of ``mamba2.naive``
and the softmax attention formula of ``griffin.naive``, with each adapter folded into its
projection's weight (``W + lora_b @ lora_a``, a different summation than the forward's)."""
from __future__ import annotations

import numpy as np

from ..bamba.naive import naive_operator as bamba_naive_operator


def merged_adapters(p: dict) -> dict:
    """Float64 params with every ``{name}.lora_a`` / ``lora_b`` pair folded into ``{name}.weight``."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    for k in [k for k in p if k.endswith(".lora_a")]:
        name = k[:-len(".lora_a")]
        p[name + ".weight"] = p[name + ".weight"] + p.pop(name + ".lora_b") @ p.pop(k)
    return p


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """Float64 ``H`` of layer ``layer``'s mixer (``variant="full"``): ``(B, C, L, L)`` on Mamba
    layers, the softmax attention ``(B, heads, L, L)`` of ``x (B, L, 2 d_model)`` on shared
    attention layers."""
    return bamba_naive_operator(merged_adapters(p), x, cfg, layer)


__all__ = ["merged_adapters", "naive_operator"]
