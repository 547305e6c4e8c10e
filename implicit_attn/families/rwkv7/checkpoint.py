"""RWKV-7 checkpoints in flash-linear-attention's Hugging Face layout (``rwkv6.checkpoint``'s
builder with RWKV-7's tables).

Per layer ``model.layers.{i}.`` besides the norms (``C`` hidden, ``V`` value width, ``H`` heads of
``D``; ranks ``Dw, Da, Dv, Dg``): the time mix under ``attn.``: ``x_r, x_w, x_k, x_v, x_a, x_g (1, 1,
C)``, ``k_k, k_a (C,)``, ``r_k (H, D)``, ``r_proj, k_proj (C, C)``, ``v_proj (V, C)``, ``o_proj (C,
V)`` weights, ``w_lora.lora.{0,2}`` (``(Dw, C)``, ``(C, Dw)`` and ``lora.2.bias (C,)``),
``a_lora.lora.*`` (``Da``, with bias), ``v_lora.lora.*`` (``Dv``, with bias ``(V,)``; not on layer
0, whose values are the value residual), ``g_lora.lora.{0,2}.weight`` (``Dg``, no bias),
``g_norm.{weight,bias} (V,)``; the channel mix under ``ffn.``: ``x_k (C,)``, ``key.weight (F, C)``,
``value.weight (C, F)``. fla's first layout's ``attn.x_x (6, C)`` is read too (``standard_form``).
"""
from __future__ import annotations

import numpy as np

from ...nn import CheckpointError, fan_in_normal
from ..rwkv6.checkpoint import norm_init, rwkv_checkpoint
from .config import Config

MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")


def lora_shapes(name: str, inp: int, out: int, rank: int, bias: bool = True) -> dict:
    m = {f"{name}.lora.0.weight": (rank, inp), f"{name}.lora.2.weight": (out, rank)}
    return {**m, f"{name}.lora.2.bias": (out,)} if bias else m


def attn_shapes(cfg: Config, i: int) -> dict:
    """Local names (under ``attn.``) -> shapes of layer ``i``'s RWKV-7 time mix."""
    C, V, H, D = cfg.hidden_size, cfg.value_dim[i], cfg.num_heads, cfg.head_dim
    m = {n: (1, 1, C) for n in MIXES}
    m.update({"k_k": (C,), "k_a": (C,), "r_k": (H, D), "r_proj.weight": (C, C), "k_proj.weight": (C, C),
              "v_proj.weight": (V, C), "o_proj.weight": (C, V), "g_norm.weight": (V,), "g_norm.bias": (V,)})
    m.update(lora_shapes("w_lora", C, C, cfg.decay_low_rank_dim))
    m.update(lora_shapes("a_lora", C, C, cfg.a_low_rank_dim))
    if i > 0:
        m.update(lora_shapes("v_lora", C, V, cfg.v_low_rank_dim))
    m.update(lora_shapes("g_lora", C, V, cfg.gate_low_rank_dim, bias=False))
    return m


def ffn_shapes(cfg: Config, i: int) -> dict:
    """Local names (under ``ffn.``) -> shapes of an RWKV-7 channel mix."""
    C, F = cfg.hidden_size, cfg.ffn_size
    return {"x_k": (C,), "key.weight": (F, C), "value.weight": (C, F)}


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Initial value of tensor ``name``: interpolations in (0, 1), decay biases spread (per-step
    decays from ``e^{-0.6 sigmoid(-4)} ~ 0.99`` to ``e^{-0.6 sigmoid(4)} ~ 0.55``), in-context
    learning rates around ``sigmoid(0)``, removal-key scales near 1, small ``r_k``."""
    base = norm_init(name, shape, g)
    if base is not None:
        return base
    leaf = name.rsplit(".", 1)[-1]
    if leaf in MIXES or name.endswith("ffn.x_k"):
        return g.uniform(size=shape)
    if name.endswith("w_lora.lora.2.bias"):
        return np.linspace(-4.0, 4.0, shape[0]) + 0.1 * g.standard_normal(shape)
    if name.endswith("lora.2.bias"):
        return 0.5 * g.standard_normal(shape)
    if leaf in ("k_k", "k_a"):
        return 1.0 + 0.3 * g.standard_normal(shape)
    if leaf == "r_k":
        return 0.3 * g.standard_normal(shape)
    return fan_in_normal(shape, g)


def standard_form(cfg: Config, tensors: dict) -> dict:
    """fla's first RWKV-7 layout stored the six interpolation weights as one ``attn.x_x (6, C)``
    (rows r, w, k, v, a, g; fla's ``RWKV7Model.load_state_dict`` splits it): split into ``x_r ...
    x_g (1, 1, C)``. A layer with both forms is refused."""
    out = dict(tensors)
    for name in [k for k in tensors if k.endswith(".attn.x_x")]:
        prefix = name[:-len("x_x")]
        x = tensors[name]
        if tuple(x.shape) != (len(MIXES), cfg.hidden_size):
            raise CheckpointError(f"{name} has shape {tuple(x.shape)}, expected {(len(MIXES), cfg.hidden_size)}")
        both = [prefix + m for m in MIXES if prefix + m in tensors]
        if both:
            raise CheckpointError(f"{name} and {both[0]} are the same weights in two forms; keep one")
        del out[name]
        out.update({prefix + m: x[j].reshape(1, 1, -1) for j, m in enumerate(MIXES)})
    return out


CHECKPOINT = rwkv_checkpoint(Config, attn_shapes, ffn_shapes, init_rule, standard_form)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params

__all__ = ["MIXES", "lora_shapes", "attn_shapes", "ffn_shapes", "init_rule", "standard_form", "CHECKPOINT",
           "expected_shapes", "params_from_tensors", "to_params", "from_params", "init_params"]
