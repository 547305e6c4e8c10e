"""LaraMini configuration (HF ``LaraMiniConfig`` fields, ``model_type: "lara_mini"``).

Layers are Gated DeltaNet (``"linear_attention"``, ours ``"delta"``), sliding-window attention
with RoPE (``"sliding_attention"``, ours ``"sliding"``) or full attention without positional
encoding (``"full_attention"``, ours ``"attention"``), from ``layer_types`` or, without it, HF's
released pattern of period 5 (delta, sliding, delta, full, sliding). Every layer's feed-forward
part is a mixture of experts with an ungated shared expert.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from ...nn import HFConfig
from ...nn.attention import FULL_WINDOW, AttentionFields, rope_frequencies
from ...nn.config import MAX_LAYERS
from ..qwen3_next.config import DeltaNetFields

LAYER_NAMES = {"linear_attention": "delta", "sliding_attention": "sliding", "full_attention": "attention"}
HF_LAYER_NAMES = {v: k for k, v in LAYER_NAMES.items()}
PATTERN = ("delta", "sliding", "delta", "attention", "sliding")


@dataclasses.dataclass(frozen=True)
class Config(DeltaNetFields, AttentionFields, HFConfig):
    """The fields of HF ``LaraMiniConfig`` the forward pass needs (HF's defaults, those of
    Lara-4-Mini). ``rope_theta`` is read from ``rope_parameters`` (only ``rope_type:
    "default"``, over the whole head, as HF's rotary embedding computes it)."""

    model_type: ClassVar[str] = "lara_mini"
    architecture: ClassVar[str] = "LaraMiniForCausalLM"
    label: ClassVar[str] = "LaraMini"
    norm_weight_in_float32: ClassVar[bool] = True  # HF applies the norms' weight before the cast
    # the DeltaNet's input projections as stored: one ``in_proj``, rows ``[q | k | v | z | b | a]``;
    # its gated norm stored as ``out_norm``
    projections: ClassVar[str] = "fused"
    delta_norm_name: ClassVar[str] = "out_norm.weight"
    # what ``lfm2.block``'s attention functions read: per-head q/k norms, no output gate
    attention_names: ClassVar[dict] = {"q_norm": "q_norm.weight", "k_norm": "k_norm.weight", "out": "o_proj",
                                       "gate": None}

    vocab_size: int
    hidden_size: int = 1024
    num_hidden_layers: int = 34
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    rope_theta: float = 10000.0
    sliding_window: int = 512
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 8
    linear_num_value_heads: int = 16
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 4
    num_experts: int = 128
    norm_topk_prob: bool = True
    layer_types: tuple | None = None

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it) and resolve ``layer_types=None``."""
        self.check_ints("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                        "sliding_window", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                        "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
                        "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_floats("rms_norm_eps", low=0.0)
        self.check_floats("rope_theta", above=0.0)
        self.check_bools("tie_word_embeddings", "attention_bias", "norm_topk_prob")
        self.check_choice("hidden_act", ("silu",), self.label)
        n = self.num_hidden_layers
        self.check_layer_kinds("layer_types", LAYER_NAMES, tuple(PATTERN[i % len(PATTERN)] for i in range(n)))
        if len(self.layer_types) != n:
            raise ValueError(f"num_hidden_layers ({n}) must equal the number of layer_types ({len(self.layer_types)})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts "
                             f"({self.num_experts})]")
        self.check_attention_fields()

    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    @property
    def norm_eps(self) -> float:
        """The eps of the attention's q/k norms (``lfm2.block`` reads this name)."""
        return self.rms_norm_eps

    @property
    def attention_window_size(self) -> int:
        return FULL_WINDOW

    def window(self, kind: str) -> int:
        """Keys at distance ``>= window`` are masked in a ``kind`` attention layer."""
        return self.sliding_window if kind == "sliding" else FULL_WINDOW

    def rope_frequencies(self, kind: str) -> np.ndarray:
        """RoPE angular frequencies of a ``kind`` attention layer, float32: ``theta ** (-2i /
        head_dim)`` ``(head_dim / 2,)`` on sliding layers, none ``(0,)`` on full ones (HF passes
        them no rotary embedding)."""
        if kind != "sliding":
            return np.zeros((0,), np.float32)
        return rope_frequencies(self.rope_theta, self.head_dim)

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        return ("moe",) * self.num_hidden_layers

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        """``rope_parameters.rope_theta`` (``rope_type`` must be ``"default"``); a null
        ``sliding_window`` is refused by name."""
        if "sliding_window" in d and d["sliding_window"] is None:
            raise ValueError(f"{cls.label} sliding_window null (sliding layers without a window) is not supported")
        rope = d.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"rope_parameters must be an object, got {rope!r}")
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{cls.label} rope_type {rope['rope_type']!r} is not supported (only 'default')")
        if rope.get("rope_theta") is not None:
            kw["rope_theta"] = rope["rope_theta"]
        return kw

    def write_hf(self, d: dict) -> dict:
        d["layer_types"] = [HF_LAYER_NAMES[t] for t in self.layer_types]
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
        return d


__all__ = ["Config", "LAYER_NAMES", "HF_LAYER_NAMES", "PATTERN"]
