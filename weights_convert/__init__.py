"""The public converter package: Hugging Face checkpoints <-> ``(Config, params)`` of any
family in ``implicit_attn.registry``, and the safetensors / HF-directory I/O.

    from weights_convert import to_params, read_hf_dir
    config, tensors = read_hf_dir("path/to/hf_dir")
    cfg, params = to_params(config, tensors)       # the family from config["model_type"]

It depends only on the registry (and the checkpoint I/O the families use); adding a
family changes nothing here.
"""
from __future__ import annotations

from implicit_attn.nn.checkpoint import (INDEX, SINGLE, CheckpointError, cast_floating, check_floating,
                                         check_tensors, floating_dtype, read_config, read_header, read_hf_dir, read_index,
                                         read_safetensors, release, write_hf_dir, write_safetensors)
from implicit_attn.registry import family, model_types, read_family_checkpoint


def to_params(config: dict, tensors: dict):
    """HF config dict + tensors -> ``(Config, params)`` of the family named by
    ``config["model_type"]``, after its strict checks."""
    return family(config.get("model_type")).to_params(config, tensors)


def from_params(cfg, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
    return family(cfg.model_type).from_params(cfg, params)


def expected_shapes(cfg) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes for a family ``Config``."""
    return family(cfg.model_type).expected_shapes(cfg)


def convert(path, dtype=None):
    """Read an HF directory into ``(Config, params)`` (optionally cast to a float ``dtype``):
    the family's own checkpoint, a container's language model, a file under transformers'
    ``state_dict()`` names, or a fine-grained FP8, compressed-tensors or ModelOpt checkpoint, dequantized
    (``registry.read_family_checkpoint``). Without ``dtype`` the params are
    read-only views into memory maps of the files (see ``read_safetensors``); a non-floating
    tensor is a ``CheckpointError``."""
    spec, config, tensors = read_family_checkpoint(path, floating_dtype(dtype))
    check_floating(tensors, where=str(path))
    return spec.to_params(config, cast_floating(tensors, dtype))


__all__ = ["CheckpointError", "read_header", "read_safetensors", "release", "check_floating", "write_safetensors", "read_config", "read_index", "read_hf_dir",
           "write_hf_dir", "check_tensors", "cast_floating", "to_params", "from_params", "expected_shapes",
           "convert", "model_types", "SINGLE", "INDEX"]
