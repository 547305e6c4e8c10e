"""MiniMax NNX modules: the lightning attention mixer, Bamba's attention mixer, decoder layer and
LM classes with MiniMax's pure functions."""
from __future__ import annotations

import functools

from ...nn import Mixer
from ..bamba.modules import LM as BambaLM
from ..bamba.modules import AttentionMixer as BambaAttentionMixer
from ..bamba.modules import BambaLayer
from .block import VARIANTS, layer_forward_jit, lm_forward_jit, mixer_forward_jit, mixer_operator_jit
from .config import Config


def tap_shape(cfg: Config, kind: str, B: int, L: int) -> tuple[tuple, str]:
    """Shape of a ``kind`` mixer's operator output, and its axes for messages."""
    if kind == "lightning":
        return (B, cfg.lightning_channels, L), "(batch, channels, length)"
    return (B, cfg.num_attention_heads, L, cfg.head_dim), "(batch, heads, length, head_dim)"


class LightningMixer(Mixer):
    """HF ``MiniMaxLightningAttention``: ``__call__(h)`` its forward, ``as_operator(x, variant)`` its
    exact operator (channels = heads x head width; ``block.lightning_operator``)."""

    label = "MiniMax"
    variants = VARIANTS
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="lightning"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="lightning"))


class AttentionMixer(BambaAttentionMixer):
    """HF ``MiniMaxAttention``: full causal GQA attention with RoPE over the whole head (and a
    sliding window if the config has one); ``as_operator`` gives the explicit attention."""

    label = "MiniMax"
    variants = VARIANTS
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="attention"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="attention", variant="full"))


class MiniMaxLayer(BambaLayer):
    """HF ``MiniMaxDecoderLayer``: ``input_layernorm``, ``mixer``, ``pre_ff_layernorm`` (HF's
    ``post_attention_layernorm``), ``feed_forward`` (HF's ``block_sparse_moe``)."""

    layer_forward_fn = staticmethod(layer_forward_jit)
    attention_class = AttentionMixer
    tap_shape_fn = staticmethod(tap_shape)

    def make_mixer(self, cfg: Config, kind: str, params: dict):
        return LightningMixer(cfg, params) if kind == "lightning" else AttentionMixer(cfg, params)


class LM(BambaLM):
    """``MiniMaxForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "minimax"
    label = "MiniMax"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    layer_class = MiniMaxLayer

    def describe(self) -> dict:
        c = self.config
        return {"layer_types": list(c.layer_types), "d_model": c.hidden_size, "heads": c.num_attention_heads,
                "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "block_size": c.block_size,
                "sliding_window": c.sliding_window, "experts": c.num_local_experts,
                "experts_per_token": c.num_experts_per_tok, "d_expert": c.intermediate_size}


__all__ = ["tap_shape", "LightningMixer", "AttentionMixer", "MiniMaxLayer", "LM"]
