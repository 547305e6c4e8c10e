"""Mamba-2 checkpoints: Mamba's ``backbone.*`` layout with the Mamba-2 mixer tensors (one
shape table), HF tensors <-> params, and ``init_params`` drawn from the same table."""
from __future__ import annotations

import jax.numpy as jnp

from ...nn import CheckpointError, check_tensors, random_tensors
from ..mamba.checkpoint import expected_shapes as residual_shapes
from ..mamba.checkpoint import init_rule, params_from_tensors, tensors_from_params
from .config import Config


def mixer_shapes(cfg: Config) -> dict:
    """Local tensor names -> shapes of one mixer.

    ``in_proj`` rows are ``[z0, x0 (d_mlp each), z (C), xBC (C + 2 G N), dt (H)]`` with
    ``C = num_heads * head_dim`` and ``d_mlp = expand * hidden_size - C`` (0 in HF configs).
    """
    D, H, K = cfg.hidden_size, cfg.num_heads, cfg.conv_kernel
    m = {"in_proj.weight": (cfg.proj_size, D), "conv1d.weight": (cfg.conv_dim, 1, K), "dt_bias": (H,),
         "A_log": (H,), "D": (H,), "norm.weight": (cfg.d_ssm,), "out_proj.weight": (D, cfg.intermediate_size)}
    if cfg.use_conv_bias:
        m["conv1d.bias"] = (cfg.conv_dim,)
    if cfg.use_bias:
        m["in_proj.bias"] = (cfg.proj_size,)
        m["out_proj.bias"] = (D,)
    return m


def expected_shapes(cfg: Config) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes for ``cfg``."""
    return residual_shapes(cfg, mixer_shapes)


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    try:
        cfg = Config.from_hf(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"mamba2 config: {e}") from e
    # Old checkpoints name the embedding "embedding" (HF renames it on load too).
    if "backbone.embedding.weight" in tensors and "backbone.embeddings.weight" not in tensors:
        tensors = dict(tensors)
        tensors["backbone.embeddings.weight"] = tensors.pop("backbone.embedding.weight")
    check_tensors(tensors, *expected_shapes(cfg), where="mamba2 checkpoint")
    return cfg, params_from_tensors(cfg, tensors)


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
    t = tensors_from_params(cfg, params, "Mamba-2")
    check_tensors(t, *expected_shapes(cfg), where="mamba2 params")
    return cfg.to_hf(), t


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM`` (HF-like scales), drawn from the shape
    table. ``key``: int seed or JAX PRNG key."""
    return params_from_tensors(cfg, random_tensors(expected_shapes(cfg)[0], init_rule, key, dtype))


__all__ = ["mixer_shapes", "expected_shapes", "to_params", "from_params", "init_params"]
