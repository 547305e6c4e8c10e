"""Bailing-Hybrid configuration (HF ``BailingHybridConfig``, Ling 3.0): Kimi-Linear's fields
(``kimi_linear.Config``) with Bailing's defaults and its own ones.

The KDA heads are the attention heads (``num_attention_heads`` of ``head_dim``; conv width
``short_conv_kernel_size``), as HF derives them where config.json does not give
``linear_num_heads``, ``linear_head_dim`` or ``linear_conv_kernel_dim``. Layer kinds: ``layer_types``, or the last
layer of every ``layer_group_size`` is MLA; feed-forward kinds: ``mlp_layer_types``, or the
first ``first_k_dense_replace`` (default 2) dense. The KDA forget gate is bounded
(``kda_safe_gate``: log decays ``kda_lower_bound * sigmoid(exp(A_log) g)``) or Kimi's. MLA has
RoPE on its shared key part (``rope_theta``; HF takes the frequencies from ``head_dim``, so only
``qk_rope_head_dim == head_dim`` runs as meant) and a per-head output gate.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...nn.config import MAX_LAYERS, read_rope_parameters
from ..kimi_linear import Config as KimiLinearConfig
from ..kimi_linear.config import read_attribute_names

# Kimi-Linear's KDA sizes, which HF's Bailing config derives from these fields of its own
# unless config.json gives them (its keyword arguments are set after the derivation)
DERIVED = {"linear_head_dim": "head_dim", "linear_num_heads": "num_attention_heads",
           "linear_conv_kernel_dim": "short_conv_kernel_size"}


@dataclasses.dataclass(frozen=True)
class Config(KimiLinearConfig):
    """The fields of HF ``BailingHybridConfig`` the forward pass needs (HF's defaults)."""

    model_type: ClassVar[str] = "bailing_hybrid"
    architecture: ClassVar[str] = "BailingHybridForCausalLM"
    label: ClassVar[str] = "Bailing-Hybrid"
    delta_out_name: ClassVar[str] = "dense.weight"
    forget_projections: ClassVar[tuple] = ("f_proj.weight",)
    gate_projections: ClassVar[tuple] = ("g_proj.weight",)
    attention_out_name: ClassVar[str] = "dense"
    attention_head_gate: ClassVar[bool] = True
    router_bias_name: ClassVar[str] = "gate.expert_bias"

    vocab_size: int = 157184
    hidden_size: int = 2560
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 42
    num_experts: int = 512
    num_expert_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-6
    pad_token_id: int | None = 156892
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    layer_group_size: int = 6
    first_k_dense_replace: int = 2
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    rope_theta: float = 6_000_000.0
    linear_head_dim: int | None = None
    linear_num_heads: int | None = None
    linear_conv_kernel_dim: int | None = None

    def __post_init__(self):
        """HF's derived sizes and defaults, then Kimi-Linear's checks and Bailing's (``ValueError``
        naming the field)."""
        self.check_ints("head_dim", "short_conv_kernel_size", "layer_group_size", "num_attention_heads")
        self.check_ints("first_k_dense_replace", low=0)
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_bools("kda_safe_gate")
        self.check_floats("kda_lower_bound", high=0.0)
        self.check_floats("rope_theta", above=0.0)
        for name, source in DERIVED.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(self, source))
        n = self.num_hidden_layers
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", tuple(
                "full_attention" if (i + 1) % self.layer_group_size == 0 else "linear_attention" for i in range(n)))
        if self.mlp_layer_types is None:
            object.__setattr__(self, "mlp_layer_types", tuple(
                "dense" if i < self.first_k_dense_replace else "sparse" for i in range(n)))
        super().__post_init__()
        if self.qk_rope_head_dim != self.head_dim:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must equal head_dim ({self.head_dim}): "
                             f"HF takes the MLA's rotary frequencies from head_dim")

    @property
    def gate_lower_bound(self) -> float | None:
        return self.kda_lower_bound if self.kda_safe_gate else None

    @property
    def mla_rope_theta(self) -> float | None:
        return self.rope_theta

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        """HF's ``attribute_map`` names and ``rope_parameters`` (``rope_type`` default only)."""
        kw = read_rope_parameters(d, kw, cls.label)
        kw.pop("partial_rotary_factor", None)
        if "pad_token_id" in d and d["pad_token_id"] is None:
            kw["pad_token_id"] = None
        return read_attribute_names(d, kw)

    def write_hf(self, d: dict) -> dict:
        d = super().write_hf(d)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d["rope_theta"]}
        return d


__all__ = ["Config", "DERIVED"]
