"""Mamba configuration (HF ``MambaConfig`` fields)."""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from ...nn import HFConfig


@dataclasses.dataclass(frozen=True)
class Config(HFConfig):
    """The fields of HF ``MambaConfig`` the forward pass needs."""

    model_type: ClassVar[str] = "mamba"
    architecture: ClassVar[str] = "MambaForCausalLM"

    vocab_size: int
    hidden_size: int
    state_size: int = 16
    num_hidden_layers: int = 1
    conv_kernel: int = 4
    expand: int = 2
    intermediate_size: int = 0
    time_step_rank: int = 0
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    residual_in_fp32: bool = True
    tie_word_embeddings: bool = True
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.intermediate_size == 0:
            object.__setattr__(self, "intermediate_size", int(self.expand * self.hidden_size))
        if self.time_step_rank in (0, "auto"):
            object.__setattr__(self, "time_step_rank", math.ceil(self.hidden_size / 16))
        if self.hidden_act != "silu":
            raise ValueError(f"Mamba hidden_act {self.hidden_act!r} is not supported (only 'silu')")


__all__ = ["Config"]
