"""Loading and saving whole models in Hugging Face layout, through the registry."""
from __future__ import annotations

from pathlib import Path

from .nn.checkpoint import CheckpointError, cast_floating, read_config, read_hf_dir, write_hf_dir
from .registry import FAMILIES, family


def load(path, dtype=None):
    """Load a Hugging Face checkpoint directory as a JAX model.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or shards with
        ``model.safetensors.index.json``). ``model_type`` in the config picks the family.
      dtype: optional floating dtype to cast parameters to (default: keep the checkpoint's).
    Returns:
      The family's ``LM`` (an NNX module): ``model(ids)``, ``model.operators(ids)``,
      ``model.layers[i].mixer.as_operator(x)``.
    Raises:
      ``CheckpointError`` for a missing/unreadable/mismatched checkpoint, ``ValueError``
      for an unknown ``model_type``.
    """
    config = read_config(path)
    model_type = config.get("model_type")
    if model_type is None:
        raise CheckpointError(f"{path}: config.json has no model_type; supported: {sorted(FAMILIES)}")
    spec = family(model_type)  # fails early for unknown types
    config, tensors = read_hf_dir(path)
    cfg, params = spec.to_params(config, cast_floating(tensors, dtype))
    model = spec.lm(cfg, params)
    model.source = str(Path(path))
    return model


def save(model, path, max_shard_bytes: int | None = None):
    """Write ``model`` back to Hugging Face layout (config.json + safetensors)."""
    config, tensors = family(model.family).from_params(model.config, model.params())
    write_hf_dir(path, config, tensors, max_shard_bytes=max_shard_bytes)


def family_of(path) -> str:
    """``model_type`` of a checkpoint directory."""
    return read_config(path).get("model_type")


__all__ = ["load", "save", "family_of", "CheckpointError"]
