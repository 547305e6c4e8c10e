"""Falcon-H1 checkpoints: the shape table (HF names), HF tensors <-> params, and
``init_params`` drawn from the same table.

HF layout (Bamba's, ``bamba.checkpoint.layout_shapes``): ``model.embed_tokens.weight``,
``model.final_layernorm.weight``, ``lm_head.weight`` (unless tied); per layer
``model.layers.{i}.{input_layernorm,pre_ff_layernorm}.weight``, both mixers,
``mamba.*`` (HF Mamba-2 names; ``norm.weight`` only with ``mamba_rms_norm``,
``out_proj.bias`` with ``projectors_bias``) and ``self_attn.{q,k,v,o}_proj.*``, and
``feed_forward.{gate,up,down}_proj.*``. HF's ``mup_vector`` is a buffer computed from the
config and is not stored. The layer's ``mixer`` params keep the ``mamba.`` / ``self_attn.``
prefixes.
"""
from __future__ import annotations

import jax.numpy as jnp

from ...nn import hf_from_params, init_from_table, params_from_hf
from ..bamba.checkpoint import Layout, init_rule, layout_params, layout_shapes, layout_tensors, mlp_shapes
from .config import Config

LAYOUT = Layout("falcon_h1", "model.final_layernorm.weight", "pre_ff_layernorm.weight", "feed_forward.",
                lambda cfg, i: mlp_shapes(cfg))


def expected_shapes(cfg: Config) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes."""
    return layout_shapes(cfg, LAYOUT)


def params_from_tensors(cfg: Config, tensors: dict) -> dict:
    """HF tensors (already checked) -> the ``LM`` parameter tree."""
    return layout_params(cfg, tensors, LAYOUT)


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    return params_from_hf(Config, expected_shapes, params_from_tensors, config, tensors, "falcon_h1")


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
    return hf_from_params(cfg, layout_tensors(cfg, params, LAYOUT), expected_shapes, "falcon_h1")


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM``, drawn from the shape table (Bamba's rules)."""
    return init_from_table(cfg, expected_shapes, init_rule, params_from_tensors, key, dtype)


__all__ = ["LAYOUT", "expected_shapes", "params_from_tensors", "to_params", "from_params", "init_params"]
