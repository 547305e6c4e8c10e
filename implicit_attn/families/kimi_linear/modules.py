"""Kimi-Linear NNX modules: the KDA and MLA mixers (Qwen3-Next's mixer classes with Kimi-Linear's
pure functions), Bamba's decoder layer and LM classes."""
from __future__ import annotations

import functools

from ..bamba.modules import LM as BambaLM
from ..bamba.modules import BambaLayer
from ..qwen3_next.modules import AttentionMixer as Qwen3NextAttentionMixer
from ..qwen3_next.modules import DeltaMixer as Qwen3NextDeltaMixer
from .block import VARIANTS, layer_forward_jit, lm_forward_jit, mixer_forward_jit, mixer_operator_jit
from .config import Config


def tap_shape(cfg: Config, kind: str, B: int, L: int) -> tuple[tuple, str]:
    """Shape of a ``kind`` mixer's operator output, and its axes for messages."""
    if kind == "delta":
        return (B, cfg.delta_channels, L), "(batch, channels, length)"
    return (B, cfg.num_attention_heads, L, cfg.v_head_dim), "(batch, heads, length, v_head_dim)"


class DeltaMixer(Qwen3NextDeltaMixer):
    """HF ``KimiLinearDeltaAttention`` (Kimi Delta Attention): ``__call__(h)`` its forward,
    ``as_operator(x, variant)`` its exact operator (channels = heads x head width)."""

    label = "Kimi-Linear"
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="delta"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="delta"))


class AttentionMixer(Qwen3NextAttentionMixer):
    """HF ``KimiLinearAttention``: MLA without positional encoding; ``as_operator`` gives the
    explicit attention (channels = heads)."""

    label = "Kimi-Linear"
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="attention"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="attention", variant="full"))


class KimiLinearLayer(BambaLayer):
    """HF ``KimiLinearDecoderLayer``: ``input_layernorm``, ``mixer``, ``pre_ff_layernorm`` (HF's
    ``post_attention_layernorm``), ``feed_forward`` (HF's ``block_sparse_moe``)."""

    layer_forward_fn = staticmethod(layer_forward_jit)
    attention_class = AttentionMixer
    tap_shape_fn = staticmethod(tap_shape)

    def make_mixer(self, cfg: Config, kind: str, params: dict):
        return DeltaMixer(cfg, params) if kind == "delta" else AttentionMixer(cfg, params)


class LM(BambaLM):
    """``KimiLinearForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "kimi_linear"
    label = "Kimi-Linear"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    layer_class = KimiLinearLayer

    def describe(self) -> dict:
        c = self.config
        return {"layer_types": list(c.layer_types), "mlp_layer_types": list(c.mlp_layer_types),
                "d_model": c.hidden_size, "kda_heads": c.linear_num_heads, "kda_head_dim": c.linear_head_dim,
                "heads": c.num_attention_heads, "kv_lora_rank": c.kv_lora_rank, "q_lora_rank": c.q_lora_rank,
                "qk_head_dim": c.qk_head_dim, "v_head_dim": c.v_head_dim, "experts": c.num_experts,
                "experts_per_token": c.num_experts_per_token}


__all__ = ["tap_shape", "DeltaMixer", "AttentionMixer", "KimiLinearLayer", "LM"]
