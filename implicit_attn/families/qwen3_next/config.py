"""Qwen3-Next configuration (HF ``Qwen3NextConfig`` fields).

Layers are Gated DeltaNet (``"linear_attention"``, ours ``"delta"``) or gated full attention
(``"full_attention"``, ours ``"attention"``), from ``layer_types`` or, without it, one
attention layer every ``full_attention_interval`` layers (HF's default 4). Each layer's MLP is
a mixture of experts with a gated shared expert where ``num_experts > 0``, ``(i + 1) %
decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``; a SwiGLU MLP otherwise.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

from ...nn import HFConfig
from ...nn.attention import FULL_WINDOW, AttentionFields
from ...nn.config import MAX_LAYERS, read_rope_parameters, write_rope_parameters

LAYER_NAMES = {"linear_attention": "delta", "full_attention": "attention"}
HF_LAYER_NAMES = {"delta": "linear_attention", "attention": "full_attention"}


class DeltaNetFields:
    """Mixin of a config with Gated DeltaNet layers (``linear_num_key_heads``,
    ``linear_num_value_heads``, ``linear_key_head_dim``, ``linear_value_head_dim``,
    ``rms_norm_eps`` fields): the sizes and settings ``block.delta_parts`` reads, and full causal
    attention for the attention layers."""

    # The Gated DeltaNet's input projections: "grouped" (Qwen3-Next: ``in_proj_qkvz``, ``in_proj_ba``,
    # grouped by key head), "split" (Qwen3.5: ``in_proj_qkv``, ``_z``, ``_b``, ``_a``) or "separate"
    # (OLMo-Hybrid: ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj``, ``b_proj``, ``a_proj``) or "fused"
    # (LaraMini: one ``in_proj``, rows ``[q | k | v | z | b | a]``)
    projections: ClassVar[str] = "grouped"
    # local names of the DeltaNet's output norm weight and output projection
    delta_norm_name: ClassVar[str] = "norm.weight"
    delta_out_name: ClassVar[str] = "out_proj.weight"

    @property
    def attention_window_size(self) -> int:
        return FULL_WINDOW

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        """Operator channels of a Gated DeltaNet layer: value heads x value head width."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def delta_channels(self) -> int:
        return self.value_dim

    @property
    def delta_norm_eps(self) -> float:
        """The eps of the DeltaNet's gated output norm."""
        return self.rms_norm_eps

    @property
    def beta_scale(self) -> float:
        """The write strength is ``beta_scale * sigmoid(b)`` (OLMo-Hybrid: 2, eigenvalues down to -1)."""
        return 1.0


@dataclasses.dataclass(frozen=True)
class Config(DeltaNetFields, AttentionFields, HFConfig):
    """The fields of HF ``Qwen3NextConfig`` the forward pass needs (``rope_parameters`` read
    into ``rope_theta`` / ``partial_rotary_factor``, HF's default factor 0.25)."""

    model_type: ClassVar[str] = "qwen3_next"
    architecture: ClassVar[str] = "Qwen3NextForCausalLM"
    label: ClassVar[str] = "Qwen3-Next"

    vocab_size: int
    hidden_size: int
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    mlp_only_layers: tuple = ()
    layer_types: tuple | None = None
    full_attention_interval: int = 4

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it) and resolve ``layer_types=None``."""
        self.check_ints("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                        "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                        "decoder_sparse_step", "moe_intermediate_size", "shared_expert_intermediate_size",
                        "full_attention_interval")
        self.check_ints("num_experts", "num_experts_per_tok", low=0)
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_floats("rms_norm_eps", low=0.0)
        self.check_floats("rope_theta", above=0.0)
        self.check_floats("partial_rotary_factor", low=0.0, high=1.0)
        self.check_bools("tie_word_embeddings", "attention_bias", "norm_topk_prob")
        self.check_choice("hidden_act", ("silu",), self.label)
        n = self.num_hidden_layers
        default = tuple("attention" if (i + 1) % self.full_attention_interval == 0 else "delta" for i in range(n))
        self.check_layer_kinds("layer_types", LAYER_NAMES, default)
        if len(self.layer_types) != n:
            raise ValueError(f"num_hidden_layers ({n}) must equal the number of layer_types ({len(self.layer_types)})")
        only = self.mlp_only_layers if self.mlp_only_layers is not None else ()
        if (not isinstance(only, (tuple, list))
                or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < n for i in only)):
            raise ValueError(f"mlp_only_layers must be a list of layer indices below {n}, got {only!r}")
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(int(i) for i in only))))
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        if "moe" in self.ffn_kinds and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts "
                             f"({self.num_experts})]")
        self.check_attention_fields()

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        """``"moe"`` or ``"mlp"`` per layer (HF's rule)."""
        return tuple("moe" if (i not in self.mlp_only_layers and self.num_experts > 0
                               and (i + 1) % self.decoder_sparse_step == 0) else "mlp"
                     for i in range(self.num_hidden_layers))

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        return read_rope_parameters(d, kw, cls.label)

    def write_hf(self, d: dict) -> dict:
        d["layer_types"] = [HF_LAYER_NAMES[t] for t in self.layer_types]
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        return write_rope_parameters(d)


__all__ = ["DeltaNetFields", "Config", "LAYER_NAMES", "HF_LAYER_NAMES"]
