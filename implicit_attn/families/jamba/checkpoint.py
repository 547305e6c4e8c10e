"""Jamba checkpoints: the shape table (HF names as saved on disk), HF tensors <-> params, and
``init_params`` drawn from the same table.

HF layout (Bamba's, ``bamba.checkpoint.layout_shapes``): ``model.embed_tokens.weight``,
``model.final_layernorm.weight``, ``lm_head.weight`` (unless tied); per layer
``model.layers.{i}.{input_layernorm,pre_ff_layernorm}.weight``, the mixer (``mamba.*``, HF
Mamba names plus ``{dt,b,c}_layernorm.weight``, or ``self_attn.{q,k,v,o}_proj.weight``) and
``feed_forward.*``: ``{gate,up,down}_proj.weight`` (MLP) or ``router.weight`` and
``experts.{e}.{gate,up,down}_proj.weight`` per expert (MoE). In the params the experts are
stacked as HF holds them in memory: ``experts.gate_up_proj (E, 2I, D)``, ``experts.down_proj
(E, D, I)``.
"""
from __future__ import annotations

import jax.numpy as jnp

from ...nn import hf_from_params, init_from_table, params_from_hf
from ..bamba.checkpoint import Layout, init_rule, layout_params, layout_shapes, layout_tensors, mlp_shapes
from ..mamba.checkpoint import mixer_shapes as mamba_shapes
from .config import Config


def ffn_shapes(cfg: Config, layer: int) -> dict:
    """Local tensor names -> shapes of layer ``layer``'s feed-forward part as stored."""
    if not cfg.is_moe(layer):
        return mlp_shapes(cfg)
    D, F = cfg.hidden_size, cfg.intermediate_size
    m = {"router.weight": (cfg.num_experts, D)}
    for e in range(cfg.num_experts):
        m.update({f"experts.{e}.gate_proj.weight": (F, D), f"experts.{e}.up_proj.weight": (F, D),
                  f"experts.{e}.down_proj.weight": (D, F)})
    return m


def stack_experts(cfg: Config, layer: int, t: dict) -> dict:
    """Per-expert tensors as stored -> the stacked ``experts.gate_up_proj`` / ``experts.down_proj``."""
    if not cfg.is_moe(layer):
        return t
    E = range(cfg.num_experts)
    return {"router.weight": t["router.weight"],
            "experts.gate_up_proj": jnp.stack([jnp.concatenate([t[f"experts.{e}.gate_proj.weight"],
                                                                t[f"experts.{e}.up_proj.weight"]]) for e in E]),
            "experts.down_proj": jnp.stack([t[f"experts.{e}.down_proj.weight"] for e in E])}


def split_experts(cfg: Config, layer: int, p: dict) -> dict:
    """The inverse of ``stack_experts``."""
    if not cfg.is_moe(layer):
        return p
    F = cfg.intermediate_size
    t = {"router.weight": p["router.weight"]}
    for e in range(cfg.num_experts):
        t.update({f"experts.{e}.gate_proj.weight": p["experts.gate_up_proj"][e, :F],
                  f"experts.{e}.up_proj.weight": p["experts.gate_up_proj"][e, F:],
                  f"experts.{e}.down_proj.weight": p["experts.down_proj"][e]})
    return t


LAYOUT = Layout("jamba", "model.final_layernorm.weight", "pre_ff_layernorm.weight", "feed_forward.", ffn_shapes,
                mamba_shapes, stack_experts, split_experts)


def expected_shapes(cfg: Config) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes."""
    return layout_shapes(cfg, LAYOUT)


def params_from_tensors(cfg: Config, tensors: dict) -> dict:
    """HF tensors (already checked) -> the ``LM`` parameter tree (experts stacked)."""
    return layout_params(cfg, tensors, LAYOUT)


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    return params_from_hf(Config, expected_shapes, params_from_tensors, config, tensors, "jamba")


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
    return hf_from_params(cfg, layout_tensors(cfg, params, LAYOUT), expected_shapes, "jamba")


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM``, drawn from the shape table (Bamba's rules;
    the dt/B/C norm weights near 1)."""
    return init_from_table(cfg, expected_shapes, init_rule, params_from_tensors, key, dtype)


__all__ = ["LAYOUT", "ffn_shapes", "stack_experts", "split_experts", "expected_shapes", "params_from_tensors",
           "to_params", "from_params", "init_params"]
