"""Zamba NNX modules: Zamba2's layer and LM classes with Zamba's pure functions and its
multi-head Mamba-1 mixer."""
from __future__ import annotations

import functools

from ...nn import Mixer
from ..zamba2.modules import LM as Zamba2LM
from ..zamba2.modules import AttentionMixer as Zamba2AttentionMixer
from ..zamba2.modules import MambaLayer as Zamba2MambaLayer
from ..zamba2.modules import SharedAttentionLayer as Zamba2SharedAttentionLayer
from .block import (VARIANTS, lm_forward_jit, mamba_forward_jit, mamba_layer_forward_jit, mamba_operator_jit,
                    mixer_forward_jit, mixer_operator_jit, shared_layer_forward_jit)


class MambaMixer(Mixer):
    """HF ``ZambaMambaMixer``: ``__call__(h)`` its forward, ``as_operator(x, variant)`` its
    operator (channel ``k * head_dim + c`` = head ``k``'s channel ``c``; Mamba's variants).
    Built with ``Config.mixer_config``."""

    label = "Zamba"
    variants = VARIANTS
    forward_fn = staticmethod(mamba_forward_jit)
    operator_fn = staticmethod(mamba_operator_jit)


class AttentionMixer(Zamba2AttentionMixer):
    """The shared attention (no adapters, no RoPE; heads of ``attention_head_dim``)."""

    label = "Zamba"
    variants = VARIANTS
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="attention"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="attention", variant="full"))


class SharedAttentionLayer(Zamba2SharedAttentionLayer):
    layer_forward_fn = staticmethod(shared_layer_forward_jit)
    mixer_class = AttentionMixer


class MambaLayer(Zamba2MambaLayer):
    layer_forward_fn = staticmethod(mamba_layer_forward_jit)
    mixer_class = MambaMixer


class LM(Zamba2LM):
    """``ZambaForCausalLM`` in JAX: Zamba2's layer list (a hybrid layer is its shared
    attention, then its Mamba layer) with one shared block."""

    family = "zamba"
    label = "Zamba"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    shared_layer_class = SharedAttentionLayer
    mamba_layer_class = MambaLayer

    def describe(self) -> dict:
        c = self.config
        return {"layer_types": list(c.layer_types), "hf_layers": list(c.hf_layers),
                "hf_layer_types": list(c.layers_block_type), "shared_blocks": c.num_shared_blocks,
                "d_model": c.hidden_size, "mamba_heads": c.n_mamba_heads, "mamba_head_dim": c.mixer_config.head_dim,
                "state_size": c.mamba_d_state, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
                "head_dim": c.head_dim, "d_mlp": c.intermediate_size}


__all__ = ["MambaMixer", "AttentionMixer", "SharedAttentionLayer", "MambaLayer", "LM"]
