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
# checkpoint types holding a family's model as their language model: model_type -> Container
# (one definition per type, however many families it may hold)
CONTAINERS: dict = {}
for _container in (c for s in _SPECS for c in s.containers):
    if CONTAINERS.setdefault(_container.model_type, _container) != _container:
        raise ValueError(f"two different definitions of the container type {_container.model_type!r}")


def family(model_type) -> FamilySpec:
    """The spec of ``model_type``; ``ValueError`` naming the supported types otherwise."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def checkpoint_family(config: dict, where="config.json"):
    """``(spec, container)`` of a checkpoint's ``config.json`` dict: for a family's own
    ``model_type`` ``(spec, None)``; for a container type (``CONTAINERS``) the family of its
    language model (the ``model_type`` of ``config[container.config_key]``, which must list
    the container in ``FamilySpec.containers``) and the ``checkpoint.Container``.
    ``ValueError`` naming the supported types otherwise (``CheckpointError``, naming ``where``,
    for a container config without its language model's)."""
    model_type = config.get("model_type")
    container = CONTAINERS.get(model_type) if isinstance(model_type, str) else None
    if container is None:
        if not isinstance(model_type, str) or model_type not in FAMILIES:
            raise ValueError(f"unknown model_type {model_type!r}; supported: {sorted(FAMILIES)}, and the language "
                             f"models of {sorted(CONTAINERS)}")
        return FAMILIES[model_type], None
    inner = container.language_config(config, where)["model_type"]
    readers = sorted(s.model_type for s in _SPECS if container in s.containers)
    if inner not in readers:
        raise ValueError(f"the language model of a {model_type!r} checkpoint is of model_type {inner!r}; "
                         f"supported there: {readers}")
    return FAMILIES[inner], container


def model_types() -> list[str]:
    """Every supported ``model_type``, sorted."""
    return sorted(FAMILIES)


__all__ = ["FAMILIES", "CONTAINERS", "FamilySpec", "family", "checkpoint_family", "model_types"]
