"""RWKV-7 NNX modules: RWKV-6's classes with RWKV-7's pure functions; the time mix reads ``[x,
v_first] (B, L, C + V)`` (its input and the value residual)."""
from __future__ import annotations

from ...nn import check_block_input, check_tap
from ...nn.hooks import parse_name
from ..rwkv6.modules import LM as Rwkv6LM
from ..rwkv6.modules import Block as Rwkv6Block
from ..rwkv6.modules import ChannelMix as Rwkv6ChannelMix
from ..rwkv6.modules import TimeMix as Rwkv6TimeMix
from .block import (VARIANTS, block_forward_jit, channel_mix_forward_jit, lm_forward_jit, time_mix_forward_jit,
                    time_mix_operator_jit)
from .config import Config


class TimeMix(Rwkv6TimeMix):
    """fla ``RWKV7Attention``: ``__call__(x_ext)`` its forward, ``as_operator(x_ext, variant)`` its
    exact operator (channels = the value width). ``x_ext = [x, v_first] (B, L, C + V)``: the
    ``attn_norm`` output and layer 0's values (zeros for layer 0, which makes its own)."""

    label = "RWKV-7"
    variants = VARIANTS
    input_name = "time-mix input [x, v_first]"
    forward_fn = staticmethod(time_mix_forward_jit)
    operator_fn = staticmethod(time_mix_operator_jit)

    def check_input(self, x):
        return check_block_input(x, self.cfg.hidden_size + self.cfg.value_width, self.input_name)


class ChannelMix(Rwkv6ChannelMix):
    """fla ``RWKV7FeedForward``: ``(B, L, C) -> (B, L, C)`` on the ``ffn_norm`` output."""

    forward_fn = staticmethod(channel_mix_forward_jit)


class Block(Rwkv6Block):
    """fla ``RWKV7Block``: (layer 0: ``pre_norm``), ``h + attn(attn_norm h, v_first)``, ``h + ffn(ffn_norm h)``."""

    mixer_class = TimeMix
    channel_mix_class = ChannelMix
    block_fn = staticmethod(block_forward_jit)

    def tap_shape(self, B: int, L: int) -> tuple:
        return (B, self.cfg.value_width, L)

    def __call__(self, h, tap=None, v_first=None):
        """One layer, as in the LM forward (layer 0 applies ``pre_norm`` first).

        Args:
          h: ``(B, L, C)`` floating residual stream entering the layer (layer 0: the embeddings).
          tap: optional ``(B, V, L)`` added to the time mix's operator output.
          v_first: ``(B, L, V)`` layer 0's values (the value residual); required after layer 0.
        Returns:
          ``(B, L, C)`` residual stream leaving the layer.
        """
        h = check_block_input(h, self.cfg.hidden_size, "block input")
        B, L, _ = h.shape
        if tap is not None:
            tap = check_tap(tap, self.tap_shape(B, L))
        if v_first is None and self.index > 0:
            raise ValueError(f"RWKV-7 layer {self.index} reads layer 0's values: pass v_first (B, L, "
                             f"{self.cfg.value_width})")
        if v_first is not None:
            v_first = check_block_input(v_first, self.cfg.value_width, "v_first")
            if v_first.shape[:2] != (B, L):
                raise ValueError(f"v_first must have shape {(B, L, self.cfg.value_width)}, got {v_first.shape}")
        return type(self).block_fn(self.params(), h, cfg=self.cfg, v_first=v_first, tap=tap,
                                   first=self.index == 0)[0]


class LM(Rwkv6LM):
    """fla ``RWKV7ForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "rwkv7"
    label = "RWKV-7"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    block_class = Block

    def hook_shape(self, name: str, B: int, L: int) -> tuple:
        """As ``LanguageModel.hook_shape``; ``mixer.hook_in`` is ``[x, v_first] (B, L, C + V)``."""
        if parse_name(name)[1] == "mixer.hook_in":
            return (B, L, self.config.hidden_size + self.config.value_width)
        return super().hook_shape(name, B, L)

    def describe(self) -> dict:
        c = self.config
        return {"d_model": c.hidden_size, "heads": c.num_heads, "head_dim": c.head_dim, "value_dim": c.value_width,
                "intermediate_size": c.ffn_size}


__all__ = ["Config", "TimeMix", "ChannelMix", "Block", "LM"]
