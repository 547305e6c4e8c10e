"""Mamba NNX modules: the mixer, the residual block and the LM (shared with Mamba-2,
which only swaps the mixer and the pure forward functions)."""
from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
from flax import nnx

from ...nn import LanguageModel, Mixer, check_block_input, check_tap, held
from .block import (VARIANTS, block_forward_jit, lm_forward_jit, mixer_forward_jit, mixer_operator_jit)


class MambaMixer(Mixer):
    """NNX mixer: ``__call__(h)`` is HF ``MambaMixer.forward``; ``as_operator(x, variant)``
    its ``ImplicitOperator`` (channels = inner width; see ``block.mixer_operator``)."""

    label = "Mamba"
    variants = VARIANTS
    forward_fn = staticmethod(mixer_forward_jit)
    operator_fn = staticmethod(mixer_operator_jit)


class MambaBlock(nnx.Module):
    """Residual block ``h + mixer(rms_norm(h))`` around a ``mixer_cls`` mixer."""

    mixer_cls: ClassVar[type] = MambaMixer
    block_fn: ClassVar = staticmethod(block_forward_jit)

    def __init__(self, cfg, layer: dict):
        self.cfg = cfg
        self.norm = nnx.Param(jnp.asarray(layer["norm"]))
        self.mixer = self.mixer_cls(cfg, layer["mixer"])

    def params(self) -> dict:
        return {"norm": held(self.norm), "mixer": self.mixer.arrays()}

    def __call__(self, h, tap=None):
        """One residual block, as in the LM forward (the same pure function).

        Args:
          h: ``(B, L, d_model)`` floating residual stream entering the block.
          tap: optional ``(B, C, L)`` added to the mixer's operator output.
        Returns:
          ``(B, L, d_model)`` residual stream leaving the block (float32 when
          ``residual_in_fp32``).
        """
        h = check_block_input(h, self.cfg.hidden_size, "block input")
        if tap is not None:
            B, L, _ = h.shape
            tap = check_tap(tap, (B, self.channels, L))
        return type(self).block_fn(self.params(), h, cfg=self.cfg, tap=tap)[0]

    @property
    def channels(self) -> int:
        """Operator channels of the mixer."""
        return self.cfg.intermediate_size


class LM(LanguageModel):
    """``MambaForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "mamba"
    label = "Mamba"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    block_cls: ClassVar[type] = MambaBlock

    def __init__(self, cfg, params: dict):
        self.config = cfg
        self.embeddings = nnx.Param(jnp.asarray(params["embeddings"]))
        self.layers = nnx.List([self.block_cls(cfg, l) for l in params["layers"]])
        self.norm_f = nnx.Param(jnp.asarray(params["norm_f"]))
        head = params.get("lm_head")
        self.lm_head = None if head is None else nnx.Param(jnp.asarray(head))

    def params(self) -> dict:
        return {"embeddings": held(self.embeddings), "layers": [l.params() for l in self.layers],
                "norm_f": held(self.norm_f), "lm_head": None if self.lm_head is None else held(self.lm_head)}

    def tap_shape(self, layer: int, B: int, L: int):
        return (B, self.layers[layer].channels, L), "(batch, channels, length)"

    def describe(self) -> dict:
        c = self.config
        return {"d_model": c.hidden_size, "d_inner": c.intermediate_size, "state_size": c.state_size,
                "conv_kernel": c.conv_kernel}


__all__ = ["MambaMixer", "MambaBlock", "LM"]
