"""Mamba-2 checkpoints: Mamba's ``backbone.*`` layout with the Mamba-2 mixer tensors (one
shape table), HF tensors <-> params, and ``init_params`` drawn from the same table."""
from __future__ import annotations

import jax.numpy as jnp

from ...nn import hf_from_params, init_from_table, params_from_hf
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
         "A_log": (H,), "D": (H,), "out_proj.weight": (D, cfg.intermediate_size)}
    if cfg.norm_mode != "none":
        m["norm.weight"] = (cfg.d_ssm,)
    if cfg.use_conv_bias:
        m["conv1d.bias"] = (cfg.conv_dim,)
    if cfg.use_bias:
        m["in_proj.bias"] = (cfg.proj_size,)
    if cfg.out_proj_bias:
        m["out_proj.bias"] = (D,)
    return m


def expected_shapes(cfg: Config) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes for ``cfg``."""
    return residual_shapes(cfg, mixer_shapes)


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    # Old checkpoints name the embedding "embedding" (HF renames it on load too).
    if "backbone.embedding.weight" in tensors and "backbone.embeddings.weight" not in tensors:
        tensors = dict(tensors)
        tensors["backbone.embeddings.weight"] = tensors.pop("backbone.embedding.weight")
    return params_from_hf(Config, expected_shapes, params_from_tensors, config, tensors, "mamba2")


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
    return hf_from_params(cfg, tensors_from_params(cfg, params, "Mamba-2"), expected_shapes, "mamba2")


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM`` (HF-like scales), drawn from the shape
    table. ``key``: int seed or JAX PRNG key."""
    return init_from_table(cfg, expected_shapes, init_rule, params_from_tensors, key, dtype)


__all__ = ["mixer_shapes", "expected_shapes", "to_params", "from_params", "init_params"]
