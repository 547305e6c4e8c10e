"""Float64 reference of Falcon-H1's layer operator (for tests): the Mamba-2 formula of
``mamba2.naive`` (with the multipliers and the norm before the gate) for the first
``mamba_d_ssm`` channels, then the softmax attention of ``griffin.naive`` on the input times
``attention_in_multiplier``, each head repeated over its ``head_dim`` value features."""
from __future__ import annotations

import numpy as np

from ..griffin.naive import attention_operator
from ..mamba2.naive import naive_operator as mamba_operator


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """Float64 ``H (B, mamba_d_ssm + heads * head_dim, L, L)`` of a layer's mixer
    (``variant="full"``) for its params ``p`` and input ``x (B, L, d_model)``."""
    pm = {k[len("mamba."):]: v for k, v in p.items() if k.startswith("mamba.")}
    pa = {k[len("self_attn."):]: np.asarray(v, np.float64) for k, v in p.items() if k.startswith("self_attn.")}
    x = np.asarray(x, np.float64)
    A = attention_operator(pa, x * cfg.attention_in_multiplier, cfg)  # (B, heads, L, L)
    return np.concatenate([mamba_operator(pm, x, cfg.mixer_config), np.repeat(A, cfg.head_dim, axis=1)], axis=1)


__all__ = ["naive_operator"]
