"""Bailing-Hybrid NNX modules: Kimi-Linear's mixer, layer and LM classes, named for messages (the
math differs through ``Config``: the bounded forget gate, single-projection gates, MLA's RoPE
and per-head gate)."""
from __future__ import annotations

from ..kimi_linear import LM as KimiLinearLM
from ..kimi_linear import AttentionMixer as KimiAttentionMixer
from ..kimi_linear import DeltaMixer as KimiDeltaMixer
from ..kimi_linear import KimiLinearLayer


class DeltaMixer(KimiDeltaMixer):
    """HF ``BailingHybridDeltaAttention``: Kimi Delta Attention with a bounded forget gate."""

    label = "Bailing-Hybrid"


class AttentionMixer(KimiAttentionMixer):
    """HF ``BailingHybridAttention``: MLA with RoPE on the shared key part; ``as_operator`` gives the
    explicit attention (channels = heads, output before the per-head gate)."""

    label = "Bailing-Hybrid"


class BailingHybridLayer(KimiLinearLayer):
    """HF ``BailingHybridDecoderLayer``."""

    attention_class = AttentionMixer

    def make_mixer(self, cfg, kind: str, params: dict):
        return DeltaMixer(cfg, params) if kind == "delta" else AttentionMixer(cfg, params)


class LM(KimiLinearLM):
    """``BailingHybridForCausalLM`` in JAX. ``LM(config, params)``."""

    family = "bailing_hybrid"
    label = "Bailing-Hybrid"
    layer_class = BailingHybridLayer


__all__ = ["DeltaMixer", "AttentionMixer", "BailingHybridLayer", "LM"]
