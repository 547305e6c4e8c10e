"""Falcon-H1 (HF ``FalconH1ForCausalLM``): the block math as pure functions.

Decoder layer (``bamba.block.hybrid_layer``): ``h + mixer(rms_norm(h))``, then ``h +
mlp(rms_norm(h))`` with ``mlp(x) = m_down * down(up(x) * SiLU(m_gate * gate(x)))``. The
mixer runs two paths on the same input ``x``:

    mixer(x) = s_out * out_proj(y_ssm) + a_out * o_proj(y_attn)

``y_ssm`` is HF's Mamba-2 mixer output before ``out_proj`` (``mamba2.block`` with
``Config.mixer_config``: input times ``ssm_in_multiplier``, ``in_proj`` rows times
``ssm_multipliers``, output norm before the gate or none), ``y_attn`` the per-head output of
full causal GQA attention with RoPE on ``a_in * x`` (keys times ``key_multiplier``). The
embeddings are multiplied by ``embedding_multiplier``, the logits by ``lm_head_multiplier``.

Operator of a layer: both paths' channels side by side (``operator.ParallelCore``), the
Mamba-2 channels ``0..C-1`` and then, for head ``h`` and value feature ``k``, channel ``C +
h * head_dim + k`` whose ``H`` is head ``h``'s attention probabilities. ``output = H @ values
+ offset`` holds channel by channel, and the mixer output is the sum of the two paths'
projections of it (``s_out``, ``a_out``, ``out_proj`` and ``o_proj`` act after ``H``, outside
it, as every output projection). The variant applies to the Mamba channels (attention has
no ablations).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ...nn.attention import attention_inner, attention_operator
from ...operator import ImplicitOperator, ParallelCore
from ...ops import linear
from ..bamba.block import hybrid_functions, positions
from ..bamba.checkpoint import sub
from ..mamba2 import VARIANTS
from ..mamba2.block import mixer_inner
from ..mamba2.block import mixer_operator as mamba_operator
from .config import Config

f32 = jnp.float32


def heads_to_channels(o):
    """``(B, H, L, d) -> (B, H * d, L)`` (channel ``h * d + k``)."""
    B, H, L, d = o.shape
    return jnp.swapaxes(o, 2, 3).reshape(B, H * d, L)


def channels_to_heads(c, H: int):
    """The inverse of ``heads_to_channels``: ``(B, H * d, L) -> (B, H, L, d)``."""
    B, n, L = c.shape
    return jnp.swapaxes(c.reshape(B, H, n // H, L), 2, 3)


def mixer_forward(p: dict, h, cfg: Config, kind: str = "parallel", hook=None):
    """HF ``FalconH1DecoderLayer``'s two token mixers on ``h (B, L, d_model)``:
    ``ssm_out_multiplier * mamba(h) + attention_out_multiplier * attention(attention_in_multiplier
    * h)``, ``(B, L, d_model)``. ``hook``: optional function of the operator's output layout
    ``(B, C + heads * head_dim, L)`` (``mixer.hook_out``)."""
    mc = cfg.mixer_config
    pm, pa = sub(p, "mamba."), sub(p, "self_attn.")
    y, _ = mixer_inner(pm, h, mc)  # (B, L, C) float32
    a_in = h * jnp.asarray(cfg.attention_in_multiplier, h.dtype)
    o = attention_inner(pa, a_in, positions(*h.shape[:2]), cfg)  # (B, H, L, d)
    if hook is not None:
        C = mc.d_ssm
        out = hook(jnp.concatenate([jnp.swapaxes(y, 1, 2), heads_to_channels(o.astype(f32))], axis=1))
        y, o = jnp.swapaxes(out[:, :C], 1, 2), channels_to_heads(out[:, C:], cfg.num_attention_heads).astype(o.dtype)
    B, H, L, d = o.shape
    m = linear(y.astype(h.dtype), pm["out_proj.weight"], pm.get("out_proj.bias"))
    a = linear(jnp.swapaxes(o, 1, 2).reshape(B, L, H * d), pa["o_proj.weight"], pa.get("o_proj.bias"))
    return (m * jnp.asarray(cfg.ssm_out_multiplier, m.dtype)
            + a * jnp.asarray(cfg.attention_out_multiplier, a.dtype))


def mixer_operator(p: dict, h, cfg: Config, kind: str = "parallel", variant: str = "full") -> ImplicitOperator:
    """The layer's operator for mixer input ``h (B, L, d_model)``: the Mamba-2 operator's
    channels (``variant``) then the attention heads' probabilities, each repeated over the
    head's value features; channels ``mamba_d_ssm + heads * head_dim``."""
    pm, pa = sub(p, "mamba."), sub(p, "self_attn.")
    m = mamba_operator(pm, h, cfg.mixer_config, variant)
    a = attention_operator(pa, h * jnp.asarray(cfg.attention_in_multiplier, h.dtype), positions(*h.shape[:2]), cfg)
    cat = lambda x, y: jnp.concatenate([x, heads_to_channels(y)], axis=1)
    return ImplicitOperator(values=cat(m.values, a.values), offset=cat(m.offset, a.offset),
                            output=cat(m.output, a.output),
                            core=ParallelCore(parts=(m.core, a.core), repeats=(1, cfg.head_dim)))


def mlp_forward(p: dict, x, cfg: Config):
    """HF ``FalconH1MLP``: ``m_down * down(up(x) * SiLU(m_gate * gate(x)))`` with
    ``(m_gate, m_down) = mlp_multipliers`` (biases if ``mlp_bias``). ``(B, L, D) -> (B, L, D)``."""
    m_gate, m_down = cfg.mlp_multipliers
    g = linear(x, p["gate_proj.weight"], p.get("gate_proj.bias")) * jnp.asarray(m_gate, x.dtype)
    u = linear(x, p["up_proj.weight"], p.get("up_proj.bias")) * jax.nn.silu(g)
    return linear(u, p["down_proj.weight"], p.get("down_proj.bias")) * jnp.asarray(m_down, x.dtype)


# HF ``FalconH1DecoderLayer`` / ``FalconH1ForCausalLM``: the scaled MLP, ``embedding_multiplier``
# (``hook_embed`` is before it, on the embedding rows) and ``lm_head_multiplier``.
FUNCTIONS = hybrid_functions(mixer_forward, mixer_operator, mlp_forward,
                             embedding_scale=lambda c: c.embedding_multiplier,
                             logits_multiplier=lambda c: c.lm_head_multiplier)
decoder_layer, layer_forward, lm_forward = FUNCTIONS.decoder_layer, FUNCTIONS.layer_forward, FUNCTIONS.lm_forward
lm_forward_jit, layer_forward_jit = FUNCTIONS.lm_forward_jit, FUNCTIONS.layer_forward_jit
mixer_forward_jit, mixer_operator_jit = FUNCTIONS.mixer_forward_jit, FUNCTIONS.mixer_operator_jit

__all__ = ["VARIANTS", "heads_to_channels", "channels_to_heads", "mixer_forward", "mixer_operator", "mlp_forward",
           "decoder_layer", "layer_forward", "lm_forward", "lm_forward_jit", "layer_forward_jit",
           "mixer_forward_jit", "mixer_operator_jit"]
