"""Mamba-2 NNX modules: Mamba's block and LM with the Mamba-2 mixer and pure functions."""
from __future__ import annotations

from ..mamba.modules import LM as MambaLM
from ..mamba.modules import MambaBlock, MambaMixer
from .block import VARIANTS, block_forward_jit, lm_forward_jit, mixer_forward_jit, mixer_operator_jit


class Mamba2Mixer(MambaMixer):
    """NNX mixer: ``__call__(h)`` is HF ``Mamba2Mixer.forward``; ``as_operator(x, variant)``
    its ``Mamba2Operator`` (channels = ``num_heads * head_dim``; see ``block.mixer_operator``)."""

    label = "Mamba-2"
    variants = VARIANTS
    forward_fn = staticmethod(mixer_forward_jit)
    operator_fn = staticmethod(mixer_operator_jit)


class Mamba2Block(MambaBlock):
    """Residual block ``h + mixer(rms_norm(h))`` around a ``Mamba2Mixer``."""

    mixer_cls = Mamba2Mixer
    block_fn = staticmethod(block_forward_jit)

    @property
    def channels(self) -> int:
        return self.cfg.d_ssm


class LM(MambaLM):
    """``Mamba2ForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "mamba2"
    label = "Mamba-2"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    block_cls = Mamba2Block

    def describe(self) -> dict:
        c = self.config
        return {"d_model": c.hidden_size, "d_inner": c.intermediate_size, "num_heads": c.num_heads,
                "head_dim": c.head_dim, "n_groups": c.n_groups, "state_size": c.state_size, "d_mlp": c.d_mlp,
                "conv_kernel": c.conv_kernel, "chunk_size": c.chunk_size}


__all__ = ["Mamba2Mixer", "Mamba2Block", "LM"]
