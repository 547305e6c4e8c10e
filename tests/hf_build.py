"""Tiny random Hugging Face torch models for the tests: a thin wrapper of
``implicit_attn.testing.build_hf_model`` that skips when torch is missing."""
from __future__ import annotations

from pathlib import Path

from conftest import torch_or_skip
from implicit_attn.registry import family


def build_hf(model_type: str, path: Path | None = None, seed: int = 0, **overrides):
    """A tiny random HF model of ``model_type`` (``FamilySpec.tiny`` updated by ``overrides``;
    RecurrentGemma's flat ``rope_theta`` / ``partial_rotary_factor`` go into
    ``rope_parameters``), see ``build_hf_model``; saved to ``path`` (if given) before any
    forward pass; returns the torch model (eval)."""
    torch_or_skip()
    from implicit_attn.testing import build_hf_model

    return build_hf_model(model_type, {**family(model_type).tiny, **overrides}, seed, path)


def mamba_hf(path, **overrides):
    return build_hf("mamba", path, **overrides)


def mamba2_hf(path, seed: int = 0, **overrides):
    return build_hf("mamba2", path, seed, **overrides)


def griffin_hf(path, **overrides):
    return build_hf("recurrent_gemma", path, **overrides)


def rwkv_hf(path, **overrides):
    return build_hf("rwkv", path, **overrides)
