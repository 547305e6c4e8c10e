"""Qwen3.5 NNX modules: Qwen3-Next's mixers, layer and LM, named for messages (the math differs
only through ``Config.projections`` and the config's feed-forward kinds)."""
from __future__ import annotations

from ..qwen3_next import LM as Qwen3NextLM
from ..qwen3_next import AttentionMixer as Qwen3NextAttentionMixer
from ..qwen3_next import DeltaMixer as Qwen3NextDeltaMixer
from ..qwen3_next import Qwen3NextLayer


class DeltaMixer(Qwen3NextDeltaMixer):
    """HF ``Qwen3_5GatedDeltaNet``: Qwen3-Next's Gated DeltaNet with four plain input projections."""

    label = "Qwen3.5"


class AttentionMixer(Qwen3NextAttentionMixer):
    """HF ``Qwen3_5Attention``: Qwen3-Next's gated attention."""

    label = "Qwen3.5"


class Qwen3_5Layer(Qwen3NextLayer):
    """HF ``Qwen3_5DecoderLayer`` / ``Qwen3_5MoeDecoderLayer``."""

    attention_class = AttentionMixer
    delta_class = DeltaMixer


class LM(Qwen3NextLM):
    """``Qwen3_5ForCausalLM`` in JAX (dense SwiGLU MLPs). ``LM(config, params)``."""

    family = "qwen3_5_text"
    label = "Qwen3.5"
    layer_class = Qwen3_5Layer


class MoeLM(LM):
    """``Qwen3_5MoeForCausalLM`` in JAX (a mixture of experts in every layer)."""

    family = "qwen3_5_moe_text"
    label = "Qwen3.5-MoE"


__all__ = ["DeltaMixer", "AttentionMixer", "Qwen3_5Layer", "LM", "MoeLM"]
