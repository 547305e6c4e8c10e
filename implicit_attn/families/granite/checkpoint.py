"""GraniteMoeHybrid checkpoints: the shape table (HF names as saved on disk), HF tensors
<-> params, and ``init_params`` drawn from the same table.

HF layout: ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight`` (unless
tied); per layer ``model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight``, the
mixer (``mamba.*``, HF Mamba-2 names, or ``self_attn.{q,k,v,o}_proj.*``),
``shared_mlp.{input_linear,output_linear}.weight`` and, with experts,
``block_sparse_moe.{input_linear,output_linear,router.layer}.weight`` (experts fused:
``(E, 2I, D)`` and ``(E, D, I)``; what ``save_pretrained`` writes and hub checkpoints hold).
"""
from __future__ import annotations

import jax.numpy as jnp

from ...nn import hf_from_params, init_from_table, params_from_hf
from ..bamba.checkpoint import Layout, init_rule, layout_params, layout_shapes, layout_tensors
from .config import Config


def ffn_shapes(cfg: Config) -> dict:
    """Local tensor names -> shapes of one layer's shared MLP and MoE."""
    D, S, I, E = cfg.hidden_size, cfg.shared_intermediate_size, cfg.intermediate_size, cfg.num_local_experts
    m = {"shared_mlp.input_linear.weight": (2 * S, D), "shared_mlp.output_linear.weight": (D, S)}
    if E:
        m.update({"block_sparse_moe.input_linear.weight": (E, 2 * I, D),
                  "block_sparse_moe.output_linear.weight": (E, D, I),
                  "block_sparse_moe.router.layer.weight": (E, D)})
    return m


LAYOUT = Layout("granitemoehybrid", "model.norm.weight", "post_attention_layernorm.weight", "",
                lambda cfg, i: ffn_shapes(cfg))


def expected_shapes(cfg: Config) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes."""
    return layout_shapes(cfg, LAYOUT)


def params_from_tensors(cfg: Config, tensors: dict) -> dict:
    """HF tensors (already checked) -> the ``LM`` parameter tree (Bamba's, with the MoE and
    shared-MLP tensors as the layer's ``feed_forward``)."""
    return layout_params(cfg, tensors, LAYOUT)


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    return params_from_hf(Config, expected_shapes, params_from_tensors, config, tensors, "granitemoehybrid")


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
    return hf_from_params(cfg, layout_tensors(cfg, params, LAYOUT), expected_shapes, "granitemoehybrid")


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM``, drawn from the shape table (Bamba's rules)."""
    return init_from_table(cfg, expected_shapes, init_rule, params_from_tensors, key, dtype)


__all__ = ["LAYOUT", "ffn_shapes", "expected_shapes", "params_from_tensors", "to_params", "from_params",
           "init_params"]
