"""Qwen3.5 configurations (HF ``Qwen3_5TextConfig``, ``model_type: "qwen3_5_text"``, and
``Qwen3_5MoeTextConfig``, ``"qwen3_5_moe_text"``): Qwen3-Next's fields, with the DeltaNet's
projections stored as four plain matrices; every layer's feed-forward part is a SwiGLU MLP
(``qwen3_5_text``) or a mixture of experts with a gated shared expert (``qwen3_5_moe_text``;
HF always renormalises the top-k weights there).

HF's text rotary embedding is multimodal RoPE; on text, where the three position axes are
equal, it is plain (partial) RoPE, which is what these models compute.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..qwen3_next import Config as Qwen3NextConfig

# Qwen3-Next fields HF's Qwen3.5 configs delete (an HF config.json may still carry them; HF ignores them)
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
LAYER_RULE_FIELDS = ("decoder_sparse_step", "norm_topk_prob", "mlp_only_layers")


@dataclasses.dataclass(frozen=True)
class Config(Qwen3NextConfig):
    """The fields of HF ``Qwen3_5TextConfig`` the forward pass needs (HF's defaults)."""

    model_type: ClassVar[str] = "qwen3_5_text"
    architecture: ClassVar[str] = "Qwen3_5ForCausalLM"
    label: ClassVar[str] = "Qwen3.5"
    projections: ClassVar[str] = "split"
    ignored: ClassVar[tuple[str, ...]] = MOE_FIELDS + LAYER_RULE_FIELDS

    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_key_value_heads: int = 4
    num_experts: int = 0

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        """Qwen3-Next's reading, without the fields HF's class ignores (their defaults apply)."""
        kw = super().read_hf(d, kw)
        return {k: v for k, v in kw.items() if k not in cls.ignored}

    def write_hf(self, d: dict) -> dict:
        d = super().write_hf(d)
        for k in self.ignored:
            d.pop(k, None)
        return d


@dataclasses.dataclass(frozen=True)
class MoeConfig(Config):
    """The fields of HF ``Qwen3_5MoeTextConfig`` the forward pass needs (HF's defaults): every
    layer a mixture of experts, top-k weights renormalised."""

    model_type: ClassVar[str] = "qwen3_5_moe_text"
    architecture: ClassVar[str] = "Qwen3_5MoeForCausalLM"
    label: ClassVar[str] = "Qwen3.5-MoE"
    ignored: ClassVar[tuple[str, ...]] = ("intermediate_size",) + LAYER_RULE_FIELDS

    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_key_value_heads: int = 2
    num_experts_per_tok: int = 8
    num_experts: int = 256


__all__ = ["Config", "MoeConfig"]
