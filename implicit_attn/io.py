"""Loading and saving whole models in Hugging Face layout."""
from __future__ import annotations

import importlib
from pathlib import Path

from .models import FAMILIES, family_module


def _converter(model_type: str):
    mod = family_module(model_type)
    return mod, importlib.import_module(f"weights_convert.{mod.__name__.rsplit('.', 1)[1]}")


def load(path, dtype=None):
    """Load a Hugging Face checkpoint directory as a JAX model.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or shards with
        ``model.safetensors.index.json``). ``model_type`` in the config picks the family.
      dtype: optional floating dtype to cast parameters to (default: keep the checkpoint's).
    Returns:
      The family's ``LM`` (an NNX module): ``model(ids)``, ``model.operators(ids)``,
      ``model.layers[i].<mixer>.as_operator(x)``.
    Raises:
      ``weights_convert.CheckpointError`` for a missing/unreadable/mismatched checkpoint,
      ``ValueError`` for an unknown ``model_type``.
    """
    from weights_convert import CheckpointError, cast_floating, read_config, read_hf_dir

    config = read_config(path)
    model_type = config.get("model_type")
    if model_type is None:
        raise CheckpointError(f"{path}: config.json has no model_type; supported: {sorted(FAMILIES)}")
    mod, conv = _converter(model_type)  # fails early for unknown types
    config, tensors = read_hf_dir(path)
    cfg, params = conv.to_params(config, cast_floating(tensors, dtype))
    model = mod.LM(cfg, params)
    model.source = str(Path(path))
    return model


def save(model, path, max_shard_bytes: int | None = None):
    """Write ``model`` back to Hugging Face layout (config.json + safetensors)."""
    from weights_convert import write_hf_dir

    _, conv = _converter(model.config.to_hf()["model_type"])
    config, tensors = conv.from_params(model.config, model.params())
    write_hf_dir(path, config, tensors, max_shard_bytes=max_shard_bytes)


def family_of(path) -> str:
    """``model_type`` of a checkpoint directory."""
    from weights_convert import read_config

    return read_config(path).get("model_type")
