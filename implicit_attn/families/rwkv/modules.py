"""RWKV-4 NNX modules: the time mix (the token mixer, also ``block.mixer``), the channel
mix, the block and the LM (eval mode)."""
from __future__ import annotations

from typing import Any, ClassVar

import jax.numpy as jnp
from flax import nnx

from ...nn import LanguageModel, Mixer, Weights, check_block_input, check_tap, held
from ...nn.hooks import MID_POINTS
from .block import (VARIANTS, block_forward_jit, channel_mix_forward_jit, lm_forward_jit, time_mix_forward_jit,
                    time_mix_operator_jit)
from .config import Config


class RwkvSelfAttention(Mixer):
    """NNX time mix of block ``layer``: ``__call__(x)`` is HF ``RwkvSelfAttention.forward``
    (eval mode); ``as_operator(x, variant)`` its operator (channels = attention width).
    ``x`` is the ``ln1`` output. RWKV-5 subclasses it (its own ``forward_fn`` /
    ``operator_fn``)."""

    label = "RWKV"
    variants = VARIANTS
    input_name = "block input"
    forward_fn = staticmethod(time_mix_forward_jit)
    operator_fn = staticmethod(time_mix_operator_jit)

    def __init__(self, cfg: Config, tensors: dict, layer: int = 0):
        super().__init__(cfg, tensors)
        self.layer = layer

    def __call__(self, x):
        """``(B, L, D) -> (B, L, D)``."""
        return type(self).forward_fn(self.arrays(), self.check_input(x), cfg=self.cfg, layer=jnp.int32(self.layer))


class RwkvFeedForward(Weights):
    """NNX channel mix of block ``layer`` (eval mode)."""

    def __init__(self, cfg: Config, tensors: dict, layer: int = 0):
        super().__init__(tensors)
        self.cfg = cfg
        self.layer = layer

    def __call__(self, x):
        """``(B, L, D) -> (B, L, D)``; ``x`` is the ``ln2`` output."""
        x = check_block_input(x, self.cfg.hidden_size, "block input")
        return channel_mix_forward_jit(self.arrays(), x, cfg=self.cfg, layer=jnp.int32(self.layer))


class RwkvBlock(nnx.Module):
    """``h (+pre_ln on block 0) -> h + attention(ln1 h) -> h + feed_forward(ln2 h)``
    (halved after every ``rescale_every``-th block in eval mode). Subclasses set
    ``mixer_class`` (the time mix) and ``block_fn`` (the jitted ``block_forward``)."""

    mixer_class: ClassVar[type] = RwkvSelfAttention
    block_fn: ClassVar[Any] = staticmethod(block_forward_jit)

    def __init__(self, cfg: Config, layer: dict, index: int):
        self.cfg = cfg
        self.index = index
        self.pre_ln = None if layer.get("pre_ln") is None else Weights(layer["pre_ln"])
        self.ln1 = Weights(layer["ln1"])
        self.ln2 = Weights(layer["ln2"])
        self.attention = type(self).mixer_class(cfg, layer["attention"], index)
        self.feed_forward = RwkvFeedForward(cfg, layer["feed_forward"], index)

    @property
    def mixer(self) -> RwkvSelfAttention:
        """The block's token mixer (its time mix)."""
        return self.attention

    def params(self) -> dict:
        return {"pre_ln": None if self.pre_ln is None else self.pre_ln.arrays(),
                "ln1": self.ln1.arrays(), "ln2": self.ln2.arrays(),
                "attention": self.attention.arrays(), "feed_forward": self.feed_forward.arrays()}

    def __call__(self, h, tap=None):
        """One block, as in the LM forward (the same pure ``block_forward``; block 0 applies
        ``pre_ln`` first, as HF does).

        Args:
          h: ``(B, L, D)`` floating residual stream entering the block (for block 0: the
            embeddings).
          tap: optional ``(B, A, L)`` added to the time mix's operator output.
        Returns:
          ``(B, L, D)`` residual stream leaving the block (rescaled as in eval mode).
        """
        h = check_block_input(h, self.cfg.hidden_size, "block input")
        if tap is not None:
            B, L, _ = h.shape
            tap = check_tap(tap, (B, self.cfg.attention_hidden_size, L))
        return type(self).block_fn(self.params(), h, cfg=self.cfg, layer=jnp.int32(self.index), tap=tap)[0]


class LM(LanguageModel):
    """``RwkvForCausalLM`` (eval mode) in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "rwkv"
    label = "RWKV"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    hook_points = MID_POINTS
    block_class: ClassVar[type] = RwkvBlock

    def __init__(self, cfg: Config, params: dict):
        self.config = cfg
        self.embeddings = nnx.Param(jnp.asarray(params["embeddings"]))
        self.layers = nnx.List([type(self).block_class(cfg, l, i) for i, l in enumerate(params["layers"])])
        self.ln_out = Weights(params["ln_out"])
        head = params.get("head")
        self.head = None if head is None else nnx.Param(jnp.asarray(head))

    def params(self) -> dict:
        return {"embeddings": held(self.embeddings), "layers": [l.params() for l in self.layers],
                "ln_out": self.ln_out.arrays(), "head": None if self.head is None else held(self.head)}

    def tap_shape(self, layer: int, B: int, L: int):
        return (B, self.config.attention_hidden_size, L), "(batch, channels, length)"

    def describe(self) -> dict:
        c = self.config
        return {"d_model": c.hidden_size, "attention_hidden_size": c.attention_hidden_size,
                "intermediate_size": c.intermediate_size, "rescale_every": c.rescale_every}


__all__ = ["RwkvSelfAttention", "RwkvFeedForward", "RwkvBlock", "LM"]
