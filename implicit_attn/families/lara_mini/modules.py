"""LaraMini NNX modules: the Gated DeltaNet mixer (Qwen3-Next's class with LaraMini's
functions), the two attention mixers, and Bamba's layer and LM classes."""
from __future__ import annotations

import functools

from ..bamba.modules import LM as BambaLM
from ..bamba.modules import BambaLayer
from ..qwen3_next.modules import AttentionMixer as Qwen3NextAttentionMixer
from ..qwen3_next.modules import DeltaMixer as Qwen3NextDeltaMixer
from .block import VARIANTS, layer_forward_jit, lm_forward_jit, mixer_forward_jit, mixer_operator_jit
from .config import Config


class DeltaMixer(Qwen3NextDeltaMixer):
    """HF ``LaraMiniGatedDeltaNet``: ``__call__(h)`` its forward, ``as_operator(x, variant)`` its
    exact operator (channels = value heads x value head width)."""

    label = "LaraMini"
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="delta"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="delta"))


class AttentionMixer(Qwen3NextAttentionMixer):
    """HF ``LaraMiniAttention`` on a full-attention layer: GQA with per-head q/k norms, no
    positional encoding; ``as_operator`` gives the explicit attention (channels = heads)."""

    label = "LaraMini"
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="attention"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="attention", variant="full"))


class SlidingAttentionMixer(AttentionMixer):
    """HF ``LaraMiniAttention`` on a sliding-window layer (``sliding_window`` keys, RoPE)."""

    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="sliding"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="sliding", variant="full"))


class LaraMiniLayer(BambaLayer):
    """HF ``LaraMiniDecoderLayer``: ``input_layernorm``, ``mixer``, ``pre_ff_layernorm`` (HF's
    ``post_attention_layernorm``), ``feed_forward`` (HF's ``mlp``)."""

    layer_forward_fn = staticmethod(layer_forward_jit)

    def make_mixer(self, cfg: Config, kind: str, params: dict):
        return {"delta": DeltaMixer, "attention": AttentionMixer, "sliding": SlidingAttentionMixer}[kind](cfg, params)


class LM(BambaLM):
    """``LaraMiniForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "lara_mini"
    label = "LaraMini"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    layer_class = LaraMiniLayer

    def describe(self) -> dict:
        c = self.config
        return {"layer_types": list(c.layer_types), "d_model": c.hidden_size, "sliding_window": c.sliding_window,
                "key_heads": c.linear_num_key_heads, "value_heads": c.linear_num_value_heads,
                "key_head_dim": c.linear_key_head_dim, "value_head_dim": c.linear_value_head_dim,
                "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                "experts": c.num_experts, "experts_per_token": c.num_experts_per_tok}


__all__ = ["DeltaMixer", "AttentionMixer", "SlidingAttentionMixer", "LaraMiniLayer", "LM"]
