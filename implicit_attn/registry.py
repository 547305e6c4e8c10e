"""The one place families are listed: ``model_type -> FamilySpec``. ``io``, the CLI,
``explain``, ``weights_convert``, the tests and the benchmarks all read it.

Adding an architecture: a folder under ``families/`` whose ``__init__`` defines ``SPEC``,
and one line in ``_SPECS`` below (see the README, "Adding an architecture").
"""
from __future__ import annotations

from .families import (bailing_hybrid, bamba, falcon_h1, falcon_mamba, granite, griffin, jamba, kimi_linear, lfm2,
                       mamba, mamba2, minimax, nemotron_h, olmo_hybrid, qwen3_5, qwen3_next, rwkv, rwkv5, rwkv6,
                       rwkv7, xlstm, zamba, zamba2)
from .nn import FamilySpec

_SPECS = (mamba.SPEC, mamba2.SPEC, griffin.SPEC, rwkv.SPEC, falcon_mamba.SPEC, bamba.SPEC, granite.SPEC, jamba.SPEC,
          nemotron_h.SPEC, falcon_h1.SPEC, zamba2.SPEC, zamba.SPEC, qwen3_next.SPEC,
          qwen3_5.SPEC, qwen3_5.MOE_SPEC, olmo_hybrid.SPEC, kimi_linear.SPEC,
          bailing_hybrid.SPEC, minimax.SPEC, rwkv5.SPEC, rwkv6.SPEC, rwkv7.SPEC, lfm2.SPEC, lfm2.MOE_SPEC,
          lfm2.LFM3_SPEC, xlstm.SPEC)

FAMILIES: dict[str, FamilySpec] = {s.model_type: s for s in _SPECS}
# checkpoint types holding a family's model as their language model: model_type -> (spec, container)
CONTAINERS: dict[str, tuple] = {c.model_type: (s, c) for s in _SPECS for c in s.containers}


def family(model_type) -> FamilySpec:
    """The spec of ``model_type``; ``ValueError`` naming the supported types otherwise."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def checkpoint_family(model_type):
    """``(spec, container)`` for a checkpoint's ``model_type``: a family's own type gives
    ``(spec, None)``; a container type (``CONTAINERS``) the family of its language model and
    the ``checkpoint.Container`` that reads it. ``ValueError`` naming the supported types otherwise."""
    if isinstance(model_type, str) and model_type in CONTAINERS:
        return CONTAINERS[model_type]
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {sorted(FAMILIES)}, and the language "
                         f"models of {sorted(CONTAINERS)}")
    return FAMILIES[model_type], None


def model_types() -> list[str]:
    """Every supported ``model_type``, sorted."""
    return sorted(FAMILIES)


__all__ = ["FAMILIES", "CONTAINERS", "FamilySpec", "family", "checkpoint_family", "model_types"]
