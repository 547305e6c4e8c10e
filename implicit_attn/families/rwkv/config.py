"""RWKV-4 configuration (HF ``RwkvConfig`` fields)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...nn import HFConfig
from ...nn.config import MAX_LAYERS, MAX_SIZE


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
        """Validate every field (``ValueError`` naming the field and its value) and fill
        the derived defaults (``attention_hidden_size`` and ``intermediate_size`` 0)."""
        self.check_ints("vocab_size", "hidden_size", "context_length")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_ints("attention_hidden_size", "intermediate_size", low=0)
        self.check_ints("rescale_every", low=-MAX_SIZE)  # <= 0: no rescaling
        self.check_floats("layer_norm_epsilon", low=0.0)
        self.check_bools("tie_word_embeddings")
        if not self.attention_hidden_size:
            object.__setattr__(self, "attention_hidden_size", self.hidden_size)
        if not self.intermediate_size:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        self.check_ints("intermediate_size")

    def rescale_period(self, dtype) -> int:
        """The ``rescale_every`` in effect at compute dtype ``dtype``: HF's RWKV-4 rescales at every
        dtype (RWKV-5 only in half precision)."""
        return self.rescale_every

    def rescale(self, layer, dtype=None):
        """Eval-mode divisor of block ``layer``'s ``output`` / ``value`` weights at compute dtype
        ``dtype`` (``rescale_divisor`` of ``rescale_period``)."""
        return rescale_divisor(layer, self.rescale_period(dtype))


def rescale_divisor(layer, rescale_every: int):
    """HF's eval-mode divisor ``2 ** (layer // rescale_every)`` of block ``layer``'s
    ``attention.output`` / ``feed_forward.value`` weights (``layer`` may be a traced int);
    1 when ``rescale_every <= 0`` (no rescaling). RWKV-4 and RWKV-5 share it."""
    return 2 ** (layer // rescale_every) if rescale_every > 0 else 1


__all__ = ["Config", "rescale_divisor"]
