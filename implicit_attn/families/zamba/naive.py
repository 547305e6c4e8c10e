"""Float64 references of Zamba's mixers (for tests): each Mamba head by ``mamba.naive``'s
Mamba-1 formula on its own tensors (the heads' operators side by side), the shared attention
by ``griffin.naive``'s softmax formula."""
from __future__ import annotations

import numpy as np

from ..griffin.naive import attention_operator
from ..mamba.naive import naive_operator as mamba_naive_operator


def head_tensors(p: dict, cfg, head: int) -> dict:
    """Head ``head``'s tensors as a Mamba-1 mixer's, in float64 (numpy slicing of HF's
    interleaved ``in_proj``: x rows ``2c``, z rows ``2c + 1``)."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    P = cfg.head_dim
    c = np.arange(head * P, (head + 1) * P)
    q = {"in_proj.weight": p["in_proj.weight"][np.concatenate([2 * c, 2 * c + 1])],
         "conv1d.weight": p["conv1d.weight"][c], "x_proj.weight": p["x_proj_weight"][head],
         "dt_proj.weight": p["dt_proj_weight"][head], "dt_proj.bias": p["dt_proj_bias"][head],
         "A_log": p["A_log"][head], "D": p["D"][head]}
    if "in_proj.bias" in p:
        q["in_proj.bias"] = p["in_proj.bias"][np.concatenate([2 * c, 2 * c + 1])]
    if "conv1d.bias" in p:
        q["conv1d.bias"] = p["conv1d.bias"][c]
    return q


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """Float64 ``H`` of layer ``layer``'s mixer (``variant="full"``): ``(B, I, L, L)`` on Mamba
    layers (head by head), ``(B, heads, L, L)`` on shared attention layers."""
    x = np.asarray(x, np.float64)
    if cfg.layer_types[layer] == "mamba":
        mc = cfg.mixer_config
        return np.concatenate([mamba_naive_operator(head_tensors(p, mc, k), x, mc.head_config)
                               for k in range(mc.num_heads)], axis=1)
    return attention_operator({k: np.asarray(v, np.float64) for k, v in p.items()}, x, cfg)


__all__ = ["head_tensors", "naive_operator"]
