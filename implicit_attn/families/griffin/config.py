"""RecurrentGemma configuration (HF ``RecurrentGemmaConfig`` fields)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...nn import HFConfig
from ...nn.attention import AttentionFields
from ...nn.config import MAX_LAYERS, read_rope_parameters, write_rope_parameters

BLOCK_TYPES = ("recurrent", "attention")


@dataclasses.dataclass(frozen=True)
class Config(AttentionFields, HFConfig):
    """The fields of HF ``RecurrentGemmaConfig`` the forward pass needs."""

    model_type: ClassVar[str] = "recurrent_gemma"
    architecture: ClassVar[str] = "RecurrentGemmaForCausalLM"
    required: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads")

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 0
    lru_width: int = 0
    attention_window_size: int = 2048
    conv1d_width: int = 4
    logits_soft_cap: float = 30.0
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    block_types: tuple = ("recurrent", "recurrent", "attention")
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    # HF derives it from hidden_size / num_attention_heads, but config.json's value is set after
    head_dim: int | None = None

    def __post_init__(self):
        """Validate every field (``ValueError`` naming the field and its value) and fill
        the derived defaults (``lru_width`` and ``num_key_value_heads`` 0, ``head_dim`` None)."""
        self.check_ints("vocab_size", "hidden_size", "num_attention_heads", "attention_window_size",
                        "conv1d_width")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_ints("intermediate_size", low=2)  # the MLP is intermediate_size // 2 wide
        self.check_ints("num_key_value_heads", "lru_width", low=0)
        self.check_floats("logits_soft_cap", "rope_theta", above=0.0)
        self.check_floats("rms_norm_eps", low=0.0)
        self.check_floats("partial_rotary_factor", low=0.0, high=1.0)
        self.check_bools("attention_bias", "tie_word_embeddings")
        self.check_choice("hidden_activation", ("gelu_pytorch_tanh",), "RecurrentGemma")
        if self.head_dim is None:
            self.check_multiple("hidden_size", "num_attention_heads")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not self.lru_width:
            object.__setattr__(self, "lru_width", self.hidden_size)
        if not self.num_key_value_heads:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        bt = self.block_types
        if (not isinstance(bt, (list, tuple)) or not bt
                or any(not isinstance(b, str) or b not in BLOCK_TYPES for b in bt)):
            raise ValueError(f"block_types must be a non-empty list of {BLOCK_TYPES}, "
                             f"got {list(bt) if isinstance(bt, tuple) else bt!r}")
        object.__setattr__(self, "block_types", tuple(bt))
        self.check_attention_fields()
        self.check_multiple("lru_width", "num_attention_heads")

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Temporal block type of each layer: ``block_types`` repeated (as HF does)."""
        n = self.num_hidden_layers
        return tuple((self.block_types * (n // len(self.block_types) + 1))[:n])

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        return read_rope_parameters(d, kw, "RecurrentGemma")

    def write_hf(self, d: dict) -> dict:
        d["block_types"] = list(self.block_types)
        return write_rope_parameters(d)


__all__ = ["Config", "BLOCK_TYPES"]
