"""Mamba-2 configuration (HF ``Mamba2Config`` fields)."""
from __future__ import annotations

import dataclasses
import math
import numbers
import re
from typing import ClassVar

from ...nn import HFConfig
from ...nn.config import MAX_LAYERS, float_from_json, float_to_json


NORM_MODES = ("gate_then_norm", "norm_then_gate", "none")


@dataclasses.dataclass(frozen=True)
class Config(HFConfig):
    """The fields of HF ``Mamba2Config`` the forward pass needs."""

    model_type: ClassVar[str] = "mamba2"
    architecture: ClassVar[str] = "Mamba2ForCausalLM"
    required: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "num_heads")

    vocab_size: int
    hidden_size: int
    num_heads: int
    head_dim: int = 64
    state_size: int = 128
    n_groups: int = 1
    num_hidden_layers: int = 1
    conv_kernel: int = 4
    expand: int = 2
    chunk_size: int = 256
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    residual_in_fp32: bool = True
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    time_step_limit: tuple = (0.0, float("inf"))

    def __post_init__(self):
        """Validate every field (``ValueError`` naming the field and its value)."""
        self.check_ints("vocab_size", "hidden_size", "num_heads", "head_dim", "state_size", "n_groups",
                        "conv_kernel", "expand", "chunk_size")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_floats("layer_norm_epsilon", low=0.0)
        self.check_bools("use_bias", "use_conv_bias", "residual_in_fp32", "tie_word_embeddings")
        self.check_choice("hidden_act", ("silu",), "Mamba-2")
        lim = self.time_step_limit
        if (not isinstance(lim, (tuple, list)) or len(lim) != 2
                or any(isinstance(t, bool) or not isinstance(t, numbers.Real) for t in lim)):
            raise ValueError(f"time_step_limit must be a pair of numbers (low, high), got {lim!r}")
        lim = tuple(float(t) for t in lim)
        if not (math.isfinite(lim[0]) and 0 <= lim[0] <= lim[1]):
            raise ValueError(f"Mamba-2 time_step_limit must be (low, high) with 0 <= low <= high and low finite, "
                             f"got {lim}")
        object.__setattr__(self, "time_step_limit", lim)
        if self.num_heads % self.n_groups:
            raise ValueError(f"Mamba-2 num_heads ({self.num_heads}) must be a multiple of "
                             f"n_groups ({self.n_groups})")
        if self.d_ssm > self.intermediate_size:
            raise ValueError(f"Mamba-2 num_heads * head_dim ({self.d_ssm}) exceeds expand * hidden_size "
                             f"({self.intermediate_size})")

    @property
    def intermediate_size(self) -> int:
        """Input width of ``out_proj`` (``expand * hidden_size``)."""
        return self.expand * self.hidden_size

    @property
    def d_ssm(self) -> int:
        """SSM width = operator channels: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def d_mlp(self) -> int:
        """Width of the optional gated-MLP part of ``in_proj`` (0 for HF configs)."""
        return self.intermediate_size - self.d_ssm

    @property
    def conv_dim(self) -> int:
        return self.d_ssm + 2 * self.n_groups * self.state_size

    @property
    def proj_size(self) -> int:
        return 2 * self.d_mlp + self.d_ssm + self.conv_dim + self.num_heads

    # What HF's Mamba-2 descendants change; a subclass overrides these (Falcon-H1).
    @property
    def norm_mode(self) -> str:
        """The output norm (``NORM_MODES``): ``"gate_then_norm"`` (HF ``MambaRMSNormGated``:
        ``w * g / rms(g)`` with ``g = y SiLU(z)``), ``"norm_then_gate"`` (``w * y / rms(y) *
        SiLU(z)``) or ``"none"`` (``y SiLU(z)``, no ``norm.weight``)."""
        return "gate_then_norm"

    @property
    def in_multiplier(self) -> float:
        """Factor of the mixer input before ``in_proj``."""
        return 1.0

    @property
    def proj_multipliers(self) -> tuple | None:
        """Factors of ``in_proj``'s ``(z, x, B, C, dt)`` rows (None: none)."""
        return None

    @property
    def out_proj_bias(self) -> bool:
        """Whether ``out_proj`` has a bias (``use_bias`` in HF Mamba-2)."""
        return self.use_bias

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        lim = kw.get("time_step_limit")
        if isinstance(lim, list):
            kw["time_step_limit"] = tuple(float_from_json(t, "time_step_limit") for t in lim)
        return kw

    def write_hf(self, d: dict) -> dict:
        d["time_step_limit"] = [float_to_json(t) for t in self.time_step_limit]
        return d


@dataclasses.dataclass(frozen=True)
class MixerConfig(Config):
    """The Mamba-2 mixer config of hybrids whose inner width is ``num_heads * head_dim``
    whatever ``hidden_size`` and ``expand`` are (Nemotron-H, Falcon-H1: no MLP part in
    ``in_proj``)."""

    @property
    def intermediate_size(self) -> int:
        return self.d_ssm


def family_mixer_config(config_class, label: str, names: dict, **fields):
    """``config_class(**fields)``, the Mamba-2 config of a hybrid's Mamba layers; a
    ``ValueError`` is re-raised with the family's field names (``names``: Mamba-2 field ->
    the family's) and its ``label`` in front."""
    try:
        return config_class(**fields)
    except ValueError as e:
        msg = re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: names[m.group(1)], str(e))
        raise ValueError(f"{label} {msg}") from None


__all__ = ["Config", "MixerConfig", "NORM_MODES", "family_mixer_config"]
