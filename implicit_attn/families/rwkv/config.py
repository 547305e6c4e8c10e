"""RWKV-4 configuration (HF ``RwkvConfig`` fields)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...nn import HFConfig


@dataclasses.dataclass(frozen=True)
class Config(HFConfig):
    """The fields of HF ``RwkvConfig`` the forward pass needs."""

    model_type: ClassVar[str] = "rwkv"
    architecture: ClassVar[str] = "RwkvForCausalLM"

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int = 1
    attention_hidden_size: int = 0
    intermediate_size: int = 0
    layer_norm_epsilon: float = 1e-5
    rescale_every: int = 6
    tie_word_embeddings: bool = False
    context_length: int = 1024

    def __post_init__(self):
        if not self.attention_hidden_size:
            object.__setattr__(self, "attention_hidden_size", self.hidden_size)
        if not self.intermediate_size:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "attention_hidden_size",
                     "intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RWKV config {name} must be a positive integer, got {v!r}")
        if not isinstance(self.rescale_every, int) or isinstance(self.rescale_every, bool):
            raise ValueError(f"RWKV config rescale_every must be an integer, got {self.rescale_every!r}")

    def rescale(self, layer):
        """Eval-mode divisor ``2 ** (layer // rescale_every)`` of block ``layer``'s
        ``output`` / ``value`` weights (``layer`` may be a traced int)."""
        return 2 ** (layer // self.rescale_every) if self.rescale_every > 0 else 1


__all__ = ["Config"]
