"""Zamba (Zamba-v1, HF ``ZambaForCausalLM``): the block math as pure functions.

The layers are Zamba2's (``zamba2.block.zamba_functions``): a Mamba layer ``h +
mamba(rms_norm(h))``; a hybrid layer, our shared-attention layer (``t = linear(mlp(rms_norm(
attention(rms_norm([h, e])))))``, no adapters, no RoPE) then its Mamba layer ``h +
mamba(rms_norm(h + t))``.

The Mamba mixer (HF ``ZambaMambaMixer``) is Mamba-1 split into heads: ``in_proj``'s rows
interleave ``x`` (even rows) and ``z`` (odd rows), the depthwise conv runs on all channels,
and head ``h`` (channels ``h P ... (h + 1) P - 1``) has its own ``x_proj``, ``dt_proj``,
``A`` and ``D``, so its own ``B`` and ``C``; the heads' outputs meet in ``out_proj``. Each head
is exactly a Mamba-1 mixer of width ``P`` (``head_params``), so its operator and variants are
Mamba's; the layer's operator puts the heads side by side (``operator.ParallelCore``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ...nn.hooks import apply_out_hook
from ...operator import ImplicitOperator, ParallelCore
from ...ops import full_precision, linear
from ..bamba.block import hybrid_mixers
from ..mamba import VARIANTS
from ..mamba.block import mixer_inner as head_inner
from ..mamba.block import mixer_operator as head_operator
from ..zamba2.block import zamba_functions
from .config import MixerConfig


def head_params(p: dict, cfg: MixerConfig, head: int) -> dict:
    """Head ``head``'s tensors under HF ``MambaMixer`` names (width ``P = cfg.head_dim``) from
    the layer's HF ``ZambaMambaMixer`` tensors: ``in_proj`` rows ``2c`` (x) then ``2c + 1`` (z)
    of its channels ``c``, its conv filters, ``x_proj_weight[head]``, ``dt_proj_weight[head]``,
    ``dt_proj_bias[head]``, ``A_log[head]``, ``D[head]``."""
    P = cfg.head_dim
    own = slice(head * P, (head + 1) * P)
    W = p["in_proj.weight"]
    q = {"in_proj.weight": jnp.concatenate([W[0::2][own], W[1::2][own]]),
         "conv1d.weight": p["conv1d.weight"][own], "x_proj.weight": p["x_proj_weight"][head],
         "dt_proj.weight": p["dt_proj_weight"][head], "dt_proj.bias": p["dt_proj_bias"][head],
         "A_log": p["A_log"][head], "D": p["D"][head]}
    if "in_proj.bias" in p:
        b = p["in_proj.bias"]
        q["in_proj.bias"] = jnp.concatenate([b[0::2][own], b[1::2][own]])
    if "conv1d.bias" in p:
        q["conv1d.bias"] = p["conv1d.bias"][own]
    return q


def mamba_forward(p: dict, h, cfg: MixerConfig, hook=None):
    """HF ``ZambaMambaMixer.forward``: ``(B, L, d_model) -> (B, L, d_model)``. ``hook``:
    optional ``(B, C, L) -> (B, C, L)`` on the heads' gated outputs before ``out_proj``
    (``mixer.hook_out``)."""
    y = jnp.concatenate([head_inner(head_params(p, cfg, k), h, cfg.head_config) for k in range(cfg.num_heads)],
                        axis=-1)
    y = apply_out_hook(y, hook).astype(h.dtype)
    return linear(y, p["out_proj.weight"], p.get("out_proj.bias"))


def mamba_operator(p: dict, h, cfg: MixerConfig, variant: str = "full") -> ImplicitOperator:
    """The mixer's operator for input ``h (B, L, d_model)``: channel ``k P + c`` is head ``k``'s
    Mamba-1 channel ``c`` (``mamba.block.mixer_operator``'s variants, per head)."""
    ops = [head_operator(head_params(p, cfg, k), h, cfg.head_config, variant) for k in range(cfg.num_heads)]
    cat = lambda name: jnp.concatenate([getattr(op, name) for op in ops], axis=1)
    core = ParallelCore(parts=tuple(op.core for op in ops), repeats=(1,) * len(ops))
    return ImplicitOperator(values=cat("values"), offset=cat("offset"), output=cat("output"), core=core)


def mlp_forward(p: dict, adapters: dict, x):
    """HF ``ZambaMLP``: ``down(gelu(gate x) * up x)`` (``adapters``: none in Zamba, ``{}``).
    ``(B, L, D) -> (B, L, D)``."""
    g = jax.nn.gelu(linear(x, p["gate_proj.weight"]), approximate=False)
    return linear(g * linear(x, p["up_proj.weight"]), p["down_proj.weight"])


mamba_forward_jit = jax.jit(full_precision(mamba_forward), static_argnames=("cfg",))
mamba_operator_jit = jax.jit(full_precision(mamba_operator), static_argnames=("cfg", "variant"))
mixer_forward, mixer_operator = hybrid_mixers(mamba_forward, mamba_operator)
FUNCTIONS = zamba_functions(mixer_forward, mixer_operator, mlp_forward)
shared_layer, mamba_layer, lm_forward = FUNCTIONS.shared_layer, FUNCTIONS.mamba_layer, FUNCTIONS.lm_forward
lm_forward_jit, mixer_forward_jit, mixer_operator_jit = (FUNCTIONS.lm_forward_jit, FUNCTIONS.mixer_forward_jit,
                                                         FUNCTIONS.mixer_operator_jit)
shared_layer_forward_jit, mamba_layer_forward_jit = FUNCTIONS.shared_layer_forward_jit, FUNCTIONS.mamba_layer_forward_jit

__all__ = ["VARIANTS", "head_params", "mamba_forward", "mamba_operator", "mamba_forward_jit", "mamba_operator_jit",
           "mlp_forward", "mixer_forward",
           "mixer_operator", "FUNCTIONS", "shared_layer", "mamba_layer", "lm_forward", "lm_forward_jit",
           "mixer_forward_jit", "mixer_operator_jit", "shared_layer_forward_jit", "mamba_layer_forward_jit"]
