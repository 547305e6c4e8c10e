"""One builder of tiny random Hugging Face torch models for every registered family."""
from __future__ import annotations

from pathlib import Path

from conftest import torch_or_skip
from implicit_attn.registry import family


def build_hf(model_type: str, path: Path | None = None, seed: int = 0, **overrides):
    """A tiny random HF model of ``model_type`` (``FamilySpec.tiny`` updated by ``overrides``),
    prepared by the family's ``hf_setup`` (parameters off their trivial initial values),
    saved to ``path`` (if given) before any forward pass; returns the torch model (eval).

    RecurrentGemma: ``rope_theta`` / ``partial_rotary_factor`` overrides go into
    ``rope_parameters``; attention runs eagerly (the reference path)."""
    torch, tr = torch_or_skip()
    spec = family(model_type)
    kw = {**spec.tiny, **overrides}
    if "rope_parameters" in kw:
        rope = dict(kw["rope_parameters"])
        for k in ("rope_theta", "partial_rotary_factor"):
            if k in kw:
                rope[k] = kw.pop(k)
        kw["rope_parameters"] = rope
        kw["attn_implementation"] = "eager"
    torch.manual_seed(seed)
    model = getattr(tr, spec.hf_class)(getattr(tr, spec.hf_config_class)(**kw)).eval()
    spec.hf_setup(model, torch, seed)
    if path is not None:
        model.save_pretrained(path, safe_serialization=True)
    return model


def mamba_hf(path, **overrides):
    return build_hf("mamba", path, **overrides)


def mamba2_hf(path, seed: int = 0, **overrides):
    return build_hf("mamba2", path, seed, **overrides)


def griffin_hf(path, **overrides):
    return build_hf("recurrent_gemma", path, **overrides)


def rwkv_hf(path, **overrides):
    return build_hf("rwkv", path, **overrides)
