"""Falcon-Mamba NNX modules: Mamba's, named for messages (the math differs only through
``Config.bcdt_norm_eps``)."""
from __future__ import annotations

from typing import ClassVar

from ..mamba import LM as MambaLM
from ..mamba import MambaBlock, MambaMixer


class FalconMambaMixer(MambaMixer):
    """Mamba mixer with the weightless RMSNorm on ``dt``, ``B`` and ``C``."""

    label = "Falcon-Mamba"


class FalconMambaBlock(MambaBlock):
    mixer_cls: ClassVar[type] = FalconMambaMixer


class LM(MambaLM):
    """``FalconMambaForCausalLM`` in JAX. ``LM(config, params)``."""

    family = "falcon_mamba"
    label = "Falcon-Mamba"
    block_cls: ClassVar[type] = FalconMambaBlock


__all__ = ["FalconMambaMixer", "FalconMambaBlock", "LM"]
