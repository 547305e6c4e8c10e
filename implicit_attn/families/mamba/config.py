"""Mamba configuration (HF ``MambaConfig`` fields)."""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from ...nn import HFConfig
from ...nn.config import MAX_LAYERS


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
        """Validate every field (``ValueError`` naming the field and its value) and fill
        the derived defaults (``intermediate_size`` 0, ``time_step_rank`` 0 or ``"auto"``)."""
        self.check_ints("vocab_size", "hidden_size", "state_size", "conv_kernel", "expand")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_ints("intermediate_size", low=0)
        if self.time_step_rank != "auto":
            self.check_ints("time_step_rank", low=0)
        self.check_floats("layer_norm_epsilon", low=0.0)
        self.check_bools("use_bias", "use_conv_bias", "residual_in_fp32", "tie_word_embeddings")
        self.check_choice("hidden_act", ("silu",), "Mamba")
        if self.intermediate_size == 0:
            object.__setattr__(self, "intermediate_size", self.expand * self.hidden_size)
        if self.time_step_rank in (0, "auto"):
            object.__setattr__(self, "time_step_rank", math.ceil(self.hidden_size / 16))
        self.check_ints("intermediate_size", "time_step_rank")

    @property
    def bcdt_norm_eps(self) -> float | None:
        """``eps`` of the weightless RMSNorm on ``dt`` (before ``dt_proj``), ``B`` and ``C``
        (Falcon-Mamba); None: the block has no such norm (Mamba)."""
        return None

    @property
    def bcdt_norm_weights(self) -> bool:
        """Whether those norms have weights (Jamba: ``block.BCDT_NORMS`` in the mixer's params)."""
        return False


__all__ = ["Config"]
