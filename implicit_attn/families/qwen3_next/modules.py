"""Qwen3-Next NNX modules: the Gated DeltaNet and gated attention mixers, and Bamba's layer
and LM classes with Qwen3-Next's pure functions."""
from __future__ import annotations

import functools

from ...nn import Mixer
from ..bamba.modules import LM as BambaLM
from ..bamba.modules import AttentionMixer as BambaAttentionMixer
from ..bamba.modules import BambaLayer
from .block import VARIANTS, layer_forward_jit, lm_forward_jit, mixer_forward_jit, mixer_operator_jit
from .config import Config


class DeltaMixer(Mixer):
    """HF ``Qwen3NextGatedDeltaNet``: ``__call__(h)`` its forward, ``as_operator(x, variant)`` its
    operator (channels = value heads x value head width; ``block.delta_operator``)."""

    label = "Qwen3-Next"
    variants = VARIANTS
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="delta"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="delta"))


class AttentionMixer(BambaAttentionMixer):
    """HF ``Qwen3NextAttention``: gated full causal GQA attention with q/k norms and partial
    RoPE; ``as_operator`` gives the explicit attention (channels = heads, output before the gate)."""

    label = "Qwen3-Next"
    variants = VARIANTS
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="attention"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="attention", variant="full"))


class Qwen3NextLayer(BambaLayer):
    """HF ``Qwen3NextDecoderLayer``: ``input_layernorm``, ``mixer`` (``DeltaMixer`` or
    ``AttentionMixer``), ``pre_ff_layernorm`` (HF's ``post_attention_layernorm``), ``feed_forward``."""

    layer_forward_fn = staticmethod(layer_forward_jit)
    attention_class = AttentionMixer
    delta_class = DeltaMixer

    def make_mixer(self, cfg: Config, kind: str, params: dict):
        return self.delta_class(cfg, params) if kind == "delta" else self.attention_class(cfg, params)


class LM(BambaLM):
    """``Qwen3NextForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "qwen3_next"
    label = "Qwen3-Next"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    layer_class = Qwen3NextLayer

    def describe(self) -> dict:
        c = self.config
        return {"layer_types": list(c.layer_types), "ffn_kinds": list(c.ffn_kinds), "d_model": c.hidden_size,
                "key_heads": c.linear_num_key_heads, "value_heads": c.linear_num_value_heads,
                "key_head_dim": c.linear_key_head_dim, "value_head_dim": c.linear_value_head_dim,
                "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                "experts": c.num_experts, "experts_per_token": c.num_experts_per_tok}


__all__ = ["DeltaMixer", "AttentionMixer", "Qwen3NextLayer", "LM"]
