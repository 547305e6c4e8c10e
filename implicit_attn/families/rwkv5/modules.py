"""RWKV-5 NNX modules: RWKV-4's classes (``rwkv.modules``) with RWKV-5's time mix (the token
mixer, also ``block.mixer``); the channel mix is RWKV-4's."""
from __future__ import annotations

from ..rwkv.modules import LM as RwkvLM
from ..rwkv.modules import RwkvBlock, RwkvSelfAttention
from .block import VARIANTS, block_forward_jit, lm_forward_jit, time_mix_forward_jit, time_mix_operator_jit


class Rwkv5SelfAttention(RwkvSelfAttention):
    """HF ``Rwkv5SelfAttention`` of block ``layer`` (eval mode): ``__call__(x)`` its forward,
    ``as_operator(x, variant)`` its exact operator (channels = the hidden width). ``x`` is the
    ``ln1`` output ``(B, L, C)``."""

    label = "RWKV-5"
    variants = VARIANTS
    input_name = "time-mix input"
    forward_fn = staticmethod(time_mix_forward_jit)
    operator_fn = staticmethod(time_mix_operator_jit)


class Rwkv5Block(RwkvBlock):
    """HF ``Rwkv5Block`` (eval mode): ``h (+pre_ln on block 0) -> h + attention(ln1 h) -> h +
    feed_forward(ln2 h)``, halved after every ``rescale_every``-th block in half precision."""

    mixer_class = Rwkv5SelfAttention
    block_fn = staticmethod(block_forward_jit)


class LM(RwkvLM):
    """HF ``Rwkv5ForCausalLM`` (eval mode) in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "rwkv5"
    label = "RWKV-5"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    block_class = Rwkv5Block

    def describe(self) -> dict:
        """The RWKV-5 fields of ``info``: widths, heads, the group norm's divisor, rescaling."""
        c = self.config
        return {"d_model": c.hidden_size, "heads": c.num_heads, "head_size": c.head_size,
                "head_size_divisor": c.head_size_divisor, "intermediate_size": c.intermediate_size,
                "rescale_every": c.rescale_every}


__all__ = ["Rwkv5SelfAttention", "Rwkv5Block", "LM"]
