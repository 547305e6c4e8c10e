"""LFM2 / LFM2-MoE / LFM3 NNX modules: the gated short-conv and attention mixers, and Bamba's
layer and LM classes with LFM's pure functions (the layer also holds LFM3's sandwich norms)."""
from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

from ...nn import Mixer, held
from ..bamba.modules import LM as BambaLM
from ..bamba.modules import AttentionMixer as BambaAttentionMixer
from ..bamba.modules import BambaLayer
from .block import VARIANTS, layer_forward_jit, lm_forward_jit, mixer_forward_jit, mixer_operator_jit
from .checkpoint import SANDWICH


def tap_shape(cfg, kind: str, B: int, L: int) -> tuple[tuple, str]:
    """Shape of a ``kind`` mixer's operator output, and its axes for messages."""
    if kind == "conv":
        return (B, cfg.hidden_size, L), "(batch, channels, length)"
    return (B, cfg.num_attention_heads, L, cfg.head_dim), "(batch, heads, length, head_dim)"


class ConvMixer(Mixer):
    """HF ``Lfm2ShortConv``: ``__call__(h)`` its forward, ``as_operator(x, variant)`` its operator
    (channels = ``hidden_size``; ``block.conv_operator``)."""

    label = "LFM2"
    variants = VARIANTS
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="conv"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="conv"))


class AttentionMixer(BambaAttentionMixer):
    """HF ``Lfm2Attention`` / ``Lfm3Attention`` (full attention): GQA with q/k norms and RoPE;
    ``as_operator`` gives the explicit attention (channels = heads, output before LFM3's gate)."""

    label = "LFM2"
    variants = VARIANTS
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="attention"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="attention", variant="full"))


class SlidingAttentionMixer(AttentionMixer):
    """LFM3's sliding-window attention (``sliding_window`` keys, its own RoPE)."""

    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="sliding"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="sliding", variant="full"))


class Lfm2Layer(BambaLayer):
    """HF ``Lfm2DecoderLayer`` / ``Lfm3DecoderLayer``: ``input_layernorm`` (HF's ``operator_norm``),
    ``mixer``, ``pre_ff_layernorm`` (``ffn_norm``), ``feed_forward``, and with LFM3's sandwich
    norms ``post_mixer_norm`` / ``post_ffn_norm``."""

    layer_forward_fn = staticmethod(layer_forward_jit)
    tap_shape_fn = staticmethod(tap_shape)

    def __init__(self, cfg, kind: str, layer: dict):
        super().__init__(cfg, kind, layer)
        self.post_norms = nnx.Dict({k: nnx.Param(jnp.asarray(layer[k])) for k in SANDWICH if k in layer})

    def make_mixer(self, cfg, kind: str, params: dict):
        return {"conv": ConvMixer, "attention": AttentionMixer, "sliding": SlidingAttentionMixer}[kind](cfg, params)

    def params(self) -> dict:
        return {**super().params(), **{k: held(v) for k, v in self.post_norms.items()}}


class LM(BambaLM):
    """``Lfm2ForCausalLM`` in JAX. ``LM(config, params)`` with params from ``checkpoint.to_params``
    or ``checkpoint.init_params``."""

    family = "lfm2"
    label = "LFM2"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    layer_class = Lfm2Layer

    def describe(self) -> dict:
        c = self.config
        d = {"layer_types": list(c.layer_types), "ffn_kinds": list(c.ffn_kinds), "d_model": c.hidden_size,
             "conv_width": c.conv_L_cache, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
             "head_dim": c.head_dim}
        if "moe" in c.ffn_kinds:
            d.update(experts=c.num_experts, experts_per_token=c.num_experts_per_tok)
        return d


class MoeLM(LM):
    """``Lfm2MoeForCausalLM`` in JAX."""

    family = "lfm2_moe"
    label = "LFM2-MoE"


class Lfm3LM(LM):
    """``Lfm3ForCausalLM`` in JAX."""

    family = "lfm3"
    label = "LFM3"


__all__ = ["tap_shape", "ConvMixer", "AttentionMixer", "SlidingAttentionMixer", "Lfm2Layer", "LM", "MoeLM", "Lfm3LM"]
