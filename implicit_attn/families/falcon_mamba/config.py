"""Falcon-Mamba configuration (HF ``FalconMambaConfig`` fields): Mamba's, plus the
``eps`` of the weightless RMSNorm on ``dt``, ``B`` and ``C``."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..mamba import Config as MambaConfig


@dataclasses.dataclass(frozen=True)
class Config(MambaConfig):
    """The fields of HF ``FalconMambaConfig`` the forward pass needs."""

    model_type: ClassVar[str] = "falcon_mamba"
    architecture: ClassVar[str] = "FalconMambaForCausalLM"

    mixer_rms_eps: float = 1e-6

    def __post_init__(self):
        """Mamba's checks, and ``mixer_rms_eps`` a positive float."""
        super().__post_init__()
        self.check_floats("mixer_rms_eps", low=0.0)

    @property
    def bcdt_norm_eps(self) -> float:
        return self.mixer_rms_eps


__all__ = ["Config"]
