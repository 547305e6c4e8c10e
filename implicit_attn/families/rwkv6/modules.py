"""RWKV-6 NNX modules: the time mix (the token mixer, also ``block.mixer``), the channel mix, the
block and the LM. RWKV-7 subclasses them."""
from __future__ import annotations

from typing import Any, ClassVar

import jax.numpy as jnp
from flax import nnx

from ...nn import LanguageModel, Mixer, Weights, check_block_input, check_tap, held
from ...nn.hooks import MID_POINTS
from .block import (VARIANTS, block_forward_jit, channel_mix_forward_jit, lm_forward_jit, time_mix_forward_jit,
                    time_mix_operator_jit)
from .config import Config


class TimeMix(Mixer):
    """fla ``RWKV6Attention``: ``__call__(x)`` its forward, ``as_operator(x, variant)`` its exact
    operator (channels = the value width). ``x`` is the ``attn_norm`` output ``(B, L, C)``."""

    label = "RWKV-6"
    variants = VARIANTS
    input_name = "time-mix input"
    forward_fn = staticmethod(time_mix_forward_jit)
    operator_fn = staticmethod(time_mix_operator_jit)


class ChannelMix(Weights):
    """fla ``RWKV6FeedForward``: ``(B, L, C) -> (B, L, C)`` on the ``ffn_norm`` output."""

    forward_fn: ClassVar[Any] = staticmethod(channel_mix_forward_jit)

    def __init__(self, cfg: Config, tensors: dict):
        super().__init__(tensors)
        self.cfg = cfg

    def __call__(self, x):
        x = check_block_input(x, self.cfg.hidden_size, "channel-mix input")
        return type(self).forward_fn(self.arrays(), x, cfg=self.cfg)


class Block(nnx.Module):
    """fla ``RWKV6Block``: (layer 0: ``pre_norm``), ``h + attn(attn_norm h)``, ``h + ffn(ffn_norm h)``."""

    mixer_class: ClassVar[type] = TimeMix
    channel_mix_class: ClassVar[type] = ChannelMix
    block_fn: ClassVar[Any] = staticmethod(block_forward_jit)

    def __init__(self, cfg: Config, layer: dict, index: int):
        self.cfg = cfg
        self.index = index
        self.pre_norm = None if layer.get("pre_norm") is None else Weights(layer["pre_norm"])
        self.attn_norm = Weights(layer["attn_norm"])
        self.ffn_norm = Weights(layer["ffn_norm"])
        self.attn = type(self).mixer_class(cfg, layer["attn"])
        self.ffn = type(self).channel_mix_class(cfg, layer["ffn"])

    @property
    def mixer(self):
        """The block's token mixer (its time mix)."""
        return self.attn

    def params(self) -> dict:
        return {"pre_norm": None if self.pre_norm is None else self.pre_norm.arrays(),
                "attn_norm": self.attn_norm.arrays(), "ffn_norm": self.ffn_norm.arrays(),
                "attn": self.attn.arrays(), "ffn": self.ffn.arrays()}

    def tap_shape(self, B: int, L: int) -> tuple:
        return (B, self.cfg.value_dim, L)

    def __call__(self, h, tap=None):
        """One layer, as in the LM forward (layer 0 applies ``pre_norm`` first).

        Args:
          h: ``(B, L, C)`` floating residual stream entering the layer (layer 0: the embeddings).
          tap: optional ``(B, V, L)`` added to the time mix's operator output.
        Returns:
          ``(B, L, C)`` residual stream leaving the layer.
        """
        h = check_block_input(h, self.cfg.hidden_size, "block input")
        if tap is not None:
            tap = check_tap(tap, self.tap_shape(h.shape[0], h.shape[1]))
        return type(self).block_fn(self.params(), h, cfg=self.cfg, tap=tap)[0]


class LM(LanguageModel):
    """fla ``RWKV6ForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "rwkv6"
    label = "RWKV-6"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    hook_points = MID_POINTS
    block_class: ClassVar[type] = Block

    def __init__(self, cfg: Config, params: dict):
        self.config = cfg
        self.embeddings = nnx.Param(jnp.asarray(params["embeddings"]))
        self.layers = nnx.List([type(self).block_class(cfg, l, i) for i, l in enumerate(params["layers"])])
        self.norm = Weights(params["norm"])
        head = params.get("lm_head")
        self.lm_head = None if head is None else nnx.Param(jnp.asarray(head))

    def params(self) -> dict:
        return {"embeddings": held(self.embeddings), "layers": [l.params() for l in self.layers],
                "norm": self.norm.arrays(), "lm_head": None if self.lm_head is None else held(self.lm_head)}

    def tap_shape(self, layer: int, B: int, L: int):
        return self.layers[layer].tap_shape(B, L), "(batch, channels, length)"

    def describe(self) -> dict:
        c = self.config
        return {"d_model": c.hidden_size, "heads": c.num_heads, "key_dim": c.key_dim, "value_dim": c.value_dim,
                "intermediate_size": c.ffn_size}


__all__ = ["TimeMix", "ChannelMix", "Block", "LM"]
